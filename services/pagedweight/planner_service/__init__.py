"""The planner service (`pagedweight planner`): bit plans for registered workers over gRPC.

Torch-free: it holds block tables and routing statistics (numpy), never weights.
"""
