"""Generated gRPC stubs of proto/pagedweight/v1 (`make proto`; never edit by hand).

worker_pb2 / worker_pb2_grpc: the worker service; planner_pb2 / planner_pb2_grpc: the
planner service. Needs only grpcio and protobuf (no torch).
"""
