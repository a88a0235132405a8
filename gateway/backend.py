"""What the gateway needs from a model backend, in its own (wire-free) types.

Routes speak only these types; ``gateway/client.py`` converts them to and from
the ``sluice.v1.Generation`` protobuf messages, and tests can implement
:class:`Backend` without gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant turn of the history made."""

    id: str
    name: str
    arguments: str  # JSON text, as the client sent it


@dataclass(frozen=True)
class ContentPart:
    """One part of a message's content: text, or an image by URL (``data:`` or http(s)); exactly one is set."""

    text: str | None = None
    image_url: str | None = None


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # on a "tool" turn: the call it answers
    parts: tuple[ContentPart, ...] = ()  # a content array with images, in order (then ``content`` is "")


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = ""  # its JSON schema as JSON text; empty: no parameters


class GuidedKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Guided:
    """One output constraint: ``spec`` is the schema's JSON text, the regex or the grammar;
    ``choices`` the strings of a CHOICE; JSON_OBJECT needs neither."""

    kind: GuidedKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    source: str = ""   # the request field it came from (``guided_regex``, ...), for the errors the backend names


class ToolChoiceMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"  # the one named function


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    function_name: str = ""  # with FUNCTION


class BeamStopping(enum.Enum):
    """vLLM's ``early_stopping``: False, True or "never"."""

    DEFAULT = False
    EARLY = True
    NEVER = "never"


@dataclass(frozen=True)
class BeamSearch:
    beam_width: int
    length_penalty: float | None = None
    early_stopping: BeamStopping = BeamStopping.DEFAULT


@dataclass(frozen=True)
class GenerationParams:
    """Sampling, stopping and response options of one request (OpenAI + vLLM names).

    ``None`` means "the backend's default" for the optional fields.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled; empty: any
    bad_words: tuple[str, ...] = ()  # words the output never contains (vLLM's); empty: none
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    stream_interval: int | None = None   # tokens per streamed delta (vLLM's); None: the engine's --stream-interval
    prompt_logprobs: int | None = None  # alternatives per prompt position (vLLM's); None: no prompt logprobs
    guided: Guided | None = None
    priority: int = 0
    best_of: int | None = None  # generate this many, return the n best; None: n
    beam_search: BeamSearch | None = None
    tool_choice: ToolChoice | None = None  # None: the backend's default (auto with tools)
    parallel_tool_calls: bool | None = None
    thinking_token_budget: int | None = None  # chat with a reasoning parser: tokens to think for; None: no limit
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many tokens; None: all of it
    add_special_tokens: bool | None = None  # None: the tokenizer service's default (text: true, chat: false)
    cache_salt: str = ""  # only requests with the same salt share cached prompt blocks (vLLM's); "": no salt


@dataclass(frozen=True)
class Prompt:
    """Exactly one of ``text``, ``token_ids``, ``chat`` is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatTurn, ...] | None = None
    add_generation_prompt: bool = True
    # Chat only:
    tools: tuple[Tool, ...] = ()
    chat_template: str | None = None
    chat_template_kwargs: str = ""  # a JSON object's text; empty: none


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token id
    LENGTH = "length"
    EOS = "eos"
    STOP_STRING = "stop_string"
    ABORTED = "aborted"
    TIME_LIMIT = "time_limit"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"

    @property
    def openai(self) -> str:
        """The OpenAI ``finish_reason``: every kind of stop is "stop"."""
        if self in (FinishReason.STOP, FinishReason.EOS, FinishReason.STOP_STRING):
            return "stop"
        if self in (FinishReason.LENGTH, FinishReason.TIME_LIMIT):
            return "length"
        if self is FinishReason.ABORTED:
            return "abort"
        if self is FinishReason.TOOL_CALLS:
            return "tool_calls"
        return "error"


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    text_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    text_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class PromptTokenLogprob:
    """A prompt token's log probability given the tokens before it (None for the first)."""

    token_id: int
    text: str
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a call the model made: the first of a call has its id and name, later ones
    further fragments of its arguments' JSON text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    """New output of one of a call's ``n`` sequences; ``usage`` is cumulative for the call."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage = Usage()
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error_message: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    prompt_logprobs: tuple[PromptTokenLogprob, ...] = ()  # on a sequence's first delta, when asked for
    reasoning_content: str = ""  # new thinking of a reasoning model (then ``text`` is the answer after it)


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: tuple[int, ...]
    max_model_len: int
    token_strs: tuple[str, ...] | None = None


@dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter the backend serves: requests name it as their ``model``."""

    name: str
    base_model_name: str  # the model it was fine-tuned from: /v1/models' ``parent``


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    lora_enabled: bool = False  # whether a ``model`` other than the served one may name an adapter
    lora_adapters: tuple[LoRAAdapter, ...] = ()


class GenerateCall(Protocol):
    """One streaming generation: iterate for deltas; ``cancel()`` aborts it.

    Iteration raises :class:`gateway.errors.BackendError` when the call fails.
    """

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    def cancel(self) -> None: ...


class Backend(Protocol):
    """The text-level model backend (the tokenizer service's Generation API).

    Every method raises :class:`gateway.errors.BackendError` on failure;
    ``timeout`` is in seconds, ``None`` for no deadline; ``adapter`` names the
    LoRA adapter a request runs through, "" for the base model.
    """

    def generate(self, prompt: Prompt, params: GenerationParams, *, request_id: str,
                 timeout: float | None, adapter: str = "") -> GenerateCall: ...

    async def tokenize(self, prompt: Prompt, *, add_special_tokens: bool | None, return_token_strs: bool,
                       request_id: str, timeout: float | None, adapter: str = "") -> TokenizeResult: ...

    async def detokenize(self, token_ids: tuple[int, ...], *, request_id: str, timeout: float | None,
                         adapter: str = "") -> str: ...

    async def model_info(self, *, timeout: float | None) -> ModelInfo: ...

    async def load_lora_adapter(self, name: str, path: str, base_model_name: str, *,
                                timeout: float | None) -> LoRAAdapter:
        """Loads a PEFT adapter folder (on the backend's host) under ``name``; ``base_model_name`` "": the
        served model. ALREADY_EXISTS, INVALID_ARGUMENT and FAILED_PRECONDITION (runtime updating off) as
        the backend says."""
        ...

    async def unload_lora_adapter(self, name: str, *, timeout: float | None) -> None:
        """NOT_FOUND for an unknown name; FAILED_PRECONDITION as for loading."""
        ...

    async def reset_prefix_cache(self, *, timeout: float | None) -> bool:
        """Every engine's prefix cache forgotten: False when one refused (its requests hold blocks) or could not
        be reached."""
        ...

    async def check_ready(self, *, timeout: float) -> bool: ...

    async def close(self) -> None: ...
