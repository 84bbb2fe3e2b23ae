from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids", "min_tokens", "min_p", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    min_p: float
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "usage", "mean_expert_bits", "num_preemptions", "stop_reason", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MEAN_EXPERT_BITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    usage: Usage
    mean_expert_bits: float
    num_preemptions: int
    stop_reason: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., mean_expert_bits: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., stop_reason: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("outputs", "errors")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[StreamError]
    def __init__(self, outputs: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[StreamError, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemorySplit(_message.Message):
    __slots__ = ("budget_bytes", "expert_bytes_by_bits", "dense_weight_bytes", "workspace_bytes", "kv_used_bytes", "kv_free_bytes", "in_transit_bytes", "free_bytes", "kv_reclaimable_bytes")
    class ExpertBytesByBitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_BY_BITS_FIELD_NUMBER: _ClassVar[int]
    DENSE_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_TRANSIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_RECLAIMABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    expert_bytes_by_bits: _containers.ScalarMap[int, int]
    dense_weight_bytes: int
    workspace_bytes: int
    kv_used_bytes: int
    kv_free_bytes: int
    in_transit_bytes: int
    free_bytes: int
    kv_reclaimable_bytes: int
    def __init__(self, budget_bytes: _Optional[int] = ..., expert_bytes_by_bits: _Optional[_Mapping[int, int]] = ..., dense_weight_bytes: _Optional[int] = ..., workspace_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., kv_free_bytes: _Optional[int] = ..., in_transit_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., kv_reclaimable_bytes: _Optional[int] = ...) -> None: ...

class BitsStats(_message.Message):
    __slots__ = ("mean_expert_bits", "blocks_by_bits", "num_page_moves", "num_plans_service", "num_plans_local")
    class BlocksByBitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MEAN_EXPERT_BITS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BY_BITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGE_MOVES_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANS_SERVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    mean_expert_bits: float
    blocks_by_bits: _containers.ScalarMap[int, int]
    num_page_moves: int
    num_plans_service: int
    num_plans_local: int
    def __init__(self, mean_expert_bits: _Optional[float] = ..., blocks_by_bits: _Optional[_Mapping[int, int]] = ..., num_page_moves: _Optional[int] = ..., num_plans_service: _Optional[int] = ..., num_plans_local: _Optional[int] = ...) -> None: ...

class LoadStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage_perc", "kv_block_size", "kv_num_blocks", "kv_num_used_blocks", "kv_capacity_blocks", "num_preemptions", "num_prompt_tokens", "num_generation_tokens")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_PERC_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage_perc: float
    kv_block_size: int
    kv_num_blocks: int
    kv_num_used_blocks: int
    kv_capacity_blocks: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage_perc: _Optional[float] = ..., kv_block_size: _Optional[int] = ..., kv_num_blocks: _Optional[int] = ..., kv_num_used_blocks: _Optional[int] = ..., kv_capacity_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generation_tokens: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("model_name", "max_model_len", "ready", "planner_connected", "load", "memory", "bits", "eos_token_id", "startup")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PLANNER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    ready: bool
    planner_connected: bool
    load: LoadStats
    memory: MemorySplit
    bits: BitsStats
    eos_token_id: int
    startup: StartupProgress
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., ready: _Optional[bool] = ..., planner_connected: _Optional[bool] = ..., load: _Optional[_Union[LoadStats, _Mapping]] = ..., memory: _Optional[_Union[MemorySplit, _Mapping]] = ..., bits: _Optional[_Union[BitsStats, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., startup: _Optional[_Union[StartupProgress, _Mapping]] = ...) -> None: ...

class StartupProgress(_message.Message):
    __slots__ = ("phase", "percent", "elapsed_s", "eta_s")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    phase: str
    percent: float
    elapsed_s: float
    eta_s: float
    def __init__(self, phase: _Optional[str] = ..., percent: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., eta_s: _Optional[float] = ...) -> None: ...
