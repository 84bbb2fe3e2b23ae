from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dial(_message.Message):
    __slots__ = ("min_mean_bits", "target_itl_s")
    MIN_MEAN_BITS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ITL_S_FIELD_NUMBER: _ClassVar[int]
    min_mean_bits: float
    target_itl_s: float
    def __init__(self, min_mean_bits: _Optional[float] = ..., target_itl_s: _Optional[float] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("block_id", "bytes_by_bits", "sensitivity")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_BITS_FIELD_NUMBER: _ClassVar[int]
    SENSITIVITY_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    bytes_by_bits: _containers.RepeatedScalarFieldContainer[int]
    sensitivity: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, block_id: _Optional[str] = ..., bytes_by_bits: _Optional[_Iterable[int]] = ..., sensitivity: _Optional[_Iterable[float]] = ...) -> None: ...

class ExpertArray(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "model_name", "policy", "blocks", "num_layers", "num_experts", "top_k", "calib_mass", "calib_share", "loss_scales_json", "move_cost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    CALIB_MASS_FIELD_NUMBER: _ClassVar[int]
    CALIB_SHARE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALES_JSON_FIELD_NUMBER: _ClassVar[int]
    MOVE_COST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_name: str
    policy: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    num_layers: int
    num_experts: int
    top_k: int
    calib_mass: ExpertArray
    calib_share: ExpertArray
    loss_scales_json: str
    move_cost: float
    def __init__(self, worker_id: _Optional[str] = ..., model_name: _Optional[str] = ..., policy: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., calib_mass: _Optional[_Union[ExpertArray, _Mapping]] = ..., calib_share: _Optional[_Union[ExpertArray, _Mapping]] = ..., loss_scales_json: _Optional[str] = ..., move_cost: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("registration_id", "num_blocks")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    registration_id: str
    num_blocks: int
    def __init__(self, registration_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class RoutingWindow(_message.Message):
    __slots__ = ("counts", "mass", "num_tokens")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    MASS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[float]
    mass: _containers.RepeatedScalarFieldContainer[float]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, counts: _Optional[_Iterable[float]] = ..., mass: _Optional[_Iterable[float]] = ..., num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class KvPressure(_message.Message):
    __slots__ = ("bytes_needed", "bytes_free")
    BYTES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREE_FIELD_NUMBER: _ClassVar[int]
    bytes_needed: int
    bytes_free: int
    def __init__(self, bytes_needed: _Optional[int] = ..., bytes_free: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("worker_id", "registration_id", "direction", "num_bytes", "bits", "routing", "kv", "prompt_residual", "prompt_routing", "num_prompts", "prompt_tokens", "inter_token_s")
    class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DIRECTION_UNSPECIFIED: _ClassVar[PlanRequest.Direction]
        FREE: _ClassVar[PlanRequest.Direction]
        SPEND: _ClassVar[PlanRequest.Direction]
    DIRECTION_UNSPECIFIED: PlanRequest.Direction
    FREE: PlanRequest.Direction
    SPEND: PlanRequest.Direction
    class BitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    registration_id: str
    direction: PlanRequest.Direction
    num_bytes: int
    bits: _containers.ScalarMap[str, int]
    routing: RoutingWindow
    kv: KvPressure
    prompt_residual: _containers.RepeatedScalarFieldContainer[float]
    prompt_routing: ExpertArray
    num_prompts: int
    prompt_tokens: int
    inter_token_s: float
    def __init__(self, worker_id: _Optional[str] = ..., registration_id: _Optional[str] = ..., direction: _Optional[_Union[PlanRequest.Direction, str]] = ..., num_bytes: _Optional[int] = ..., bits: _Optional[_Mapping[str, int]] = ..., routing: _Optional[_Union[RoutingWindow, _Mapping]] = ..., kv: _Optional[_Union[KvPressure, _Mapping]] = ..., prompt_residual: _Optional[_Iterable[float]] = ..., prompt_routing: _Optional[_Union[ExpertArray, _Mapping]] = ..., num_prompts: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., inter_token_s: _Optional[float] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("plan_id", "changes", "expected_bytes_delta", "expected_damage")
    class ChangesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_DELTA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DAMAGE_FIELD_NUMBER: _ClassVar[int]
    plan_id: int
    changes: _containers.ScalarMap[str, int]
    expected_bytes_delta: int
    expected_damage: float
    def __init__(self, plan_id: _Optional[int] = ..., changes: _Optional[_Mapping[str, int]] = ..., expected_bytes_delta: _Optional[int] = ..., expected_damage: _Optional[float] = ...) -> None: ...
