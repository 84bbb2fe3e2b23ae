"""The worker service (`pagedweight worker`): one engine behind a gRPC API.

Imports only torch, grpc, protobuf and prometheus-client (no fastapi, no redis): GPU
machines run it without the gateway's dependencies.
"""
