from proto.sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_SHM_NOT_REGISTERED: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_SHM_NOT_REGISTERED: ErrorReason

class SharedMemoryRef(_message.Message):
    __slots__ = ("segment", "offset", "length", "slot")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    slot: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class EngineStoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class EngineGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_shm", "sampling", "stopping", "logprobs", "priority", "n", "stream_interval", "guided", "prompt_logprobs", "best_of", "beam_search", "lora_adapter", "trace_headers", "client_request_id", "reasoning", "cache_salt", "bad_words_token_ids", "resumed_output_tokens", "multi_modal_items", "kv_transfer")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SHM_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MULTI_MODAL_ITEMS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _common_pb2.TokenIds
    prompt_shm: SharedMemoryRef
    sampling: _common_pb2.SamplingParameters
    stopping: EngineStoppingCriteria
    logprobs: int
    priority: int
    n: int
    stream_interval: int
    guided: _common_pb2.GuidedDecoding
    prompt_logprobs: int
    best_of: int
    beam_search: _common_pb2.BeamSearch
    lora_adapter: str
    trace_headers: _containers.ScalarMap[str, str]
    client_request_id: str
    reasoning: EngineReasoning
    cache_salt: str
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenIds]
    resumed_output_tokens: int
    multi_modal_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    kv_transfer: KVTransferParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., prompt_shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParameters, _Mapping]] = ..., stopping: _Optional[_Union[EngineStoppingCriteria, _Mapping]] = ..., logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., n: _Optional[int] = ..., stream_interval: _Optional[int] = ..., guided: _Optional[_Union[_common_pb2.GuidedDecoding, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., best_of: _Optional[int] = ..., beam_search: _Optional[_Union[_common_pb2.BeamSearch, _Mapping]] = ..., lora_adapter: _Optional[str] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., client_request_id: _Optional[str] = ..., reasoning: _Optional[_Union[EngineReasoning, _Mapping]] = ..., cache_salt: _Optional[str] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[_common_pb2.TokenIds, _Mapping]]] = ..., resumed_output_tokens: _Optional[int] = ..., multi_modal_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "remote_engine_id", "transport", "remote_address", "remote_block_ids", "block_hashes", "hold_s", "layout")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    remote_engine_id: str
    transport: str
    remote_address: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    hold_s: float
    layout: str
    def __init__(self, do_remote_decode: _Optional[bool] = ..., remote_engine_id: _Optional[str] = ..., transport: _Optional[str] = ..., remote_address: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., hold_s: _Optional[float] = ..., layout: _Optional[str] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("dtype", "shape", "inline", "shm")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    inline: bytes
    shm: SharedMemoryRef
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., inline: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("modality", "offset", "length", "hash", "tensors")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    modality: str
    offset: int
    length: int
    hash: str
    tensors: _containers.MessageMap[str, TensorData]
    def __init__(self, modality: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., hash: _Optional[str] = ..., tensors: _Optional[_Mapping[str, TensorData]] = ...) -> None: ...

class EngineReasoning(_message.Message):
    __slots__ = ("end_token_id", "thinking_token_budget")
    END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    end_token_id: int
    thinking_token_budget: int
    def __init__(self, end_token_id: _Optional[int] = ..., thinking_token_budget: _Optional[int] = ...) -> None: ...

class TokenIdLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class EngineTokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenIdLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenIdLogprob, _Mapping]]] = ...) -> None: ...

class EngineGenerateResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "prompt_tokens", "cached_tokens", "released_shm_slot", "error_message", "request_id", "request_done", "cumulative_logprob", "prompt_logprobs", "kv_transfer", "kv_blocks_received")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SHM_SLOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DONE_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[EngineTokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    prompt_tokens: int
    cached_tokens: int
    released_shm_slot: int
    error_message: str
    request_id: str
    request_done: bool
    cumulative_logprob: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptTokenLogprob]
    kv_transfer: KVTransferParams
    kv_blocks_received: int
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[EngineTokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., released_shm_slot: _Optional[int] = ..., error_message: _Optional[str] = ..., request_id: _Optional[str] = ..., request_done: _Optional[bool] = ..., cumulative_logprob: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptTokenLogprob, _Mapping]]] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ..., kv_blocks_received: _Optional[int] = ...) -> None: ...

class EngineStreamRequest(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: EngineGenerateRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[EngineGenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class EngineRequestError(_message.Message):
    __slots__ = ("request_id", "code", "message", "reason", "retry_after_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    reason: ErrorReason
    retry_after_s: int
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[_Union[ErrorReason, str]] = ..., retry_after_s: _Optional[int] = ...) -> None: ...

class EngineStreamResponse(_message.Message):
    __slots__ = ("outputs", "errors")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineGenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[EngineRequestError]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineGenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[EngineRequestError, _Mapping]]] = ...) -> None: ...

class SequenceRef(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "sequences", "kv_blocks_pulled")
    class KvBlocksPulledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceRef]
    kv_blocks_pulled: _containers.ScalarMap[str, int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., sequences: _Optional[_Iterable[_Union[SequenceRef, _Mapping]]] = ..., kv_blocks_pulled: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineCounters(_message.Message):
    __slots__ = ("shm_handoffs", "inline_handoffs", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "finished_requests", "preemptions", "stream_calls")
    SHM_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    INLINE_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STREAM_CALLS_FIELD_NUMBER: _ClassVar[int]
    shm_handoffs: int
    inline_handoffs: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    finished_requests: int
    preemptions: int
    stream_calls: int
    def __init__(self, shm_handoffs: _Optional[int] = ..., inline_handoffs: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ..., preemptions: _Optional[int] = ..., stream_calls: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "block_size", "total_kv_blocks", "free_kv_blocks", "num_running", "num_waiting", "counters", "device", "dtype", "lora_enabled", "lora_adapters", "instance_id", "runner", "pooling_tasks", "embedding_size", "is_matryoshka", "matryoshka_dimensions", "labels", "prefix_caching", "prefix_caching_hash_algo", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic", "kv_cache_usage", "kv_role", "kv_transport")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TASKS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    block_size: int
    total_kv_blocks: int
    free_kv_blocks: int
    num_running: int
    num_waiting: int
    counters: EngineCounters
    device: str
    dtype: str
    lora_enabled: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoRAAdapter]
    instance_id: str
    runner: str
    pooling_tasks: _containers.RepeatedScalarFieldContainer[str]
    embedding_size: int
    is_matryoshka: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_topic: str
    kv_cache_usage: float
    kv_role: str
    kv_transport: str
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., block_size: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., counters: _Optional[_Union[EngineCounters, _Mapping]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., lora_enabled: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[_common_pb2.LoRAAdapter, _Mapping]]] = ..., instance_id: _Optional[str] = ..., runner: _Optional[str] = ..., pooling_tasks: _Optional[_Iterable[str]] = ..., embedding_size: _Optional[int] = ..., is_matryoshka: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., prefix_caching: _Optional[bool] = ..., prefix_caching_hash_algo: _Optional[str] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., kv_events_topic: _Optional[str] = ..., kv_cache_usage: _Optional[float] = ..., kv_role: _Optional[str] = ..., kv_transport: _Optional[str] = ...) -> None: ...

class EnginePoolRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "token_type_ids", "task", "normalize", "dimensions", "activation", "priority", "trace_headers", "client_request_id")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TYPE_IDS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _common_pb2.TokenIds
    token_type_ids: _containers.RepeatedScalarFieldContainer[int]
    task: str
    normalize: bool
    dimensions: int
    activation: bool
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    client_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., token_type_ids: _Optional[_Iterable[int]] = ..., task: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., activation: _Optional[bool] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., client_request_id: _Optional[str] = ...) -> None: ...

class EnginePoolResponse(_message.Message):
    __slots__ = ("data", "row_size", "prompt_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROW_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedScalarFieldContainer[float]
    row_size: int
    prompt_tokens: int
    def __init__(self, data: _Optional[_Iterable[float]] = ..., row_size: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("segment", "size_bytes", "owner")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    segment: str
    size_bytes: int
    owner: str
    def __init__(self, segment: _Optional[str] = ..., size_bytes: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
