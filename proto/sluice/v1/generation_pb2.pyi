from proto.sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "chat_template", "tools", "chat_template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    chat_template: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    chat_template_kwargs: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., chat_template: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., chat_template_kwargs: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("none", "auto", "required", "function_name")
    NONE_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    none: bool
    auto: bool
    required: bool
    function_name: str
    def __init__(self, none: _Optional[bool] = ..., auto: _Optional[bool] = ..., required: _Optional[bool] = ..., function_name: _Optional[str] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "time_limit_ms")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_MS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    time_limit_ms: int
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., time_limit_ms: _Optional[int] = ...) -> None: ...

class ResponseOptions(_message.Message):
    __slots__ = ("skip_special_tokens", "logprobs", "top_logprobs", "echo", "stream_interval", "prompt_logprobs")
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    skip_special_tokens: bool
    logprobs: bool
    top_logprobs: int
    echo: bool
    stream_interval: int
    prompt_logprobs: int
    def __init__(self, skip_special_tokens: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., stream_interval: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "chat", "token_ids", "sampling", "stopping", "response", "guided", "priority", "n", "tool_choice", "parallel_tool_calls", "best_of", "beam_search", "trace_headers", "thinking_token_budget", "truncate_prompt_tokens", "add_special_tokens", "cache_salt", "bad_words")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    chat: Chat
    token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParameters
    stopping: StoppingCriteria
    response: ResponseOptions
    guided: _common_pb2.GuidedDecoding
    priority: int
    n: int
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    best_of: int
    beam_search: _common_pb2.BeamSearch
    trace_headers: _containers.ScalarMap[str, str]
    thinking_token_budget: int
    truncate_prompt_tokens: int
    add_special_tokens: bool
    cache_salt: str
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParameters, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., response: _Optional[_Union[ResponseOptions, _Mapping]] = ..., guided: _Optional[_Union[_common_pb2.GuidedDecoding, _Mapping]] = ..., priority: _Optional[int] = ..., n: _Optional[int] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., best_of: _Optional[int] = ..., beam_search: _Optional[_Union[_common_pb2.BeamSearch, _Mapping]] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., thinking_token_budget: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "text", "text_bytes", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    text_bytes: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., text_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "text", "text_bytes", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    text_bytes: bytes
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., text_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "text", "token_ids", "logprobs", "usage", "finish_reason", "stop_string", "stop_token_id", "error_message", "tool_calls", "cumulative_logprob", "prompt_logprobs", "reasoning_content")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: _common_pb2.Usage
    finish_reason: _common_pb2.FinishReason
    stop_string: str
    stop_token_id: int
    error_message: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    cumulative_logprob: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptTokenLogprob]
    reasoning_content: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., error_message: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptTokenLogprob, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("id", "generate", "cancel", "timeout_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    id: int
    generate: GenerateRequest
    cancel: bool
    timeout_ms: int
    def __init__(self, id: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GenerateStreamItem(_message.Message):
    __slots__ = ("id", "response", "end", "status_code", "status_message", "retry_after_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: GenerateResponse
    end: bool
    status_code: int
    status_message: str
    retry_after_seconds: int
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., retry_after_seconds: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GenerateStreamItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GenerateStreamItem, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_special_tokens", "return_token_strs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: Chat
    add_special_tokens: bool
    return_token_strs: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count", "max_model_len", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids", "skip_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ApplyChatTemplateRequest(_message.Message):
    __slots__ = ("model", "chat")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    chat: Chat
    def __init__(self, model: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class ApplyChatTemplateResponse(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "has_chat_template", "lora_enabled", "lora_adapters", "runner", "pooling_tasks", "embedding_size", "is_matryoshka", "matryoshka_dimensions", "labels")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TASKS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    has_chat_template: bool
    lora_enabled: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoRAAdapter]
    runner: str
    pooling_tasks: _containers.RepeatedScalarFieldContainer[str]
    embedding_size: int
    is_matryoshka: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., lora_enabled: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[_common_pb2.LoRAAdapter, _Mapping]]] = ..., runner: _Optional[str] = ..., pooling_tasks: _Optional[_Iterable[str]] = ..., embedding_size: _Optional[int] = ..., is_matryoshka: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolingInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _common_pb2.TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "model", "inputs", "dimensions", "normalize", "truncate_prompt_tokens", "add_special_tokens", "priority", "trace_headers", "task")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[PoolingInput]
    dimensions: int
    normalize: bool
    truncate_prompt_tokens: int
    add_special_tokens: bool
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    task: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[PoolingInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., task: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "row_size", "prompt_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ROW_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    row_size: int
    prompt_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., row_size: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "usage")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: _common_pb2.Usage
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "model", "queries", "documents", "truncate_prompt_tokens", "activation", "priority", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    queries: _containers.RepeatedScalarFieldContainer[str]
    documents: _containers.RepeatedScalarFieldContainer[str]
    truncate_prompt_tokens: int
    activation: bool
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., queries: _Optional[_Iterable[str]] = ..., documents: _Optional[_Iterable[str]] = ..., truncate_prompt_tokens: _Optional[int] = ..., activation: _Optional[bool] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "prompt_tokens", "usage")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    usage: _common_pb2.Usage
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("request_id", "model", "inputs", "truncate_prompt_tokens", "add_special_tokens", "activation", "priority", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[PoolingInput]
    truncate_prompt_tokens: int
    add_special_tokens: bool
    activation: bool
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[PoolingInput, _Mapping]]] = ..., truncate_prompt_tokens: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., activation: _Optional[bool] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("scores", "label", "prompt_tokens")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    label: str
    prompt_tokens: int
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., label: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("results", "usage")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    usage: _common_pb2.Usage
    def __init__(self, results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...
