"""The pooling routes' request bodies (OpenAI's ``/v1/embeddings``; vLLM's ``/pooling``, ``/score``, ``/rerank`` and
``/classify``, with the Jina and Cohere rerank shapes), validated into the gateway's own types.

As for the generation routes (gateway/request_fields.py), every field of vLLM's and OpenAI's request models either
works (a field of a model below) or is refused with a 400 naming it; other names are logged once and ignored.
The field lists are vLLM's ``vllm/entrypoints/openai/protocol.py`` at 0052bed (EmbeddingCompletionRequest,
ScoreRequest, RerankRequest, ClassificationRequest) merged with its later ``vllm/entrypoints/pooling/*/protocol.py``
(``use_activation``, ``embed_dtype``, ``endianness``, ``truncation_side``, ``padding``, ``queries``/``documents``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gateway.errors import bad_request
from gateway.fields import validate
from gateway.models import INT32_MAX, INT32_MIN, Int, TokenId
from gateway.request_fields import Refusal, declared, log_unknown, refuse

MAX_INPUTS = 2048  # OpenAI's limit on one embeddings request's inputs; documents and texts alike here
EMBED_DTYPES = ("float32", "float16", "bfloat16")


# ---- what the routes ask of the backend, wire-free ------------------------------------------------------------------

@dataclass(frozen=True)
class PoolingInput:
    """One input: ``text`` (tokenized with ``add_special_tokens``) or ``token_ids`` (used as they are)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PoolingOptions:
    """What every pooling call takes; None: the backend's default."""

    truncate_prompt_tokens: int | None = None  # keep each input's last this many tokens
    add_special_tokens: bool | None = None
    priority: int = 0
    activation: bool | None = None  # embed: normalise; score, classify: the model's activation


@dataclass(frozen=True)
class Embeddings:
    vectors: tuple[tuple[float, ...], ...]  # per input, flat (token_embed: row_size floats per token)
    row_size: tuple[int, ...]
    prompt_tokens: int


@dataclass(frozen=True)
class Scores:
    scores: tuple[float, ...]  # per pair, in the documents' order
    prompt_tokens: int


@dataclass(frozen=True)
class Classifications:
    probs: tuple[tuple[float, ...], ...]
    labels: tuple[str, ...]
    prompt_tokens: int


@runtime_checkable
class PoolingBackend(Protocol):
    """The pooling calls of the tokenizer service's API (``gateway/client.py``). Errors raise ``BackendError``."""

    async def embed(self, inputs: Sequence[PoolingInput], options: PoolingOptions, *, dimensions: int | None,
                    task: str, request_id: str, timeout: float | None, model: str = "") -> Embeddings: ...

    async def score(self, queries: Sequence[str], documents: Sequence[str], options: PoolingOptions, *,
                    request_id: str, timeout: float | None, model: str = "") -> Scores: ...

    async def classify(self, inputs: Sequence[PoolingInput], options: PoolingOptions, *, request_id: str,
                       timeout: float | None, model: str = "") -> Classifications: ...

    async def pooling_tasks(self, *, timeout: float | None) -> tuple[str, ...]: ...


# ---- request models -------------------------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


def _input_tag(value: object) -> str | None:
    if isinstance(value, str):
        return "@text"
    if isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "@tokens"
        if value and all(isinstance(v, list) for v in value):
            return "@token_batch"
        return "@texts"
    return None


_TokenList = Annotated[list[TokenId], Field(min_length=1)]
InputArg = Annotated[
    Annotated[str, Tag("@text")]
    | Annotated[_TokenList, Tag("@tokens")]
    | Annotated[list[str], Tag("@texts"), Field(min_length=1, max_length=MAX_INPUTS)]
    | Annotated[list[_TokenList], Tag("@token_batch"), Field(min_length=1, max_length=MAX_INPUTS)],
    Discriminator(_input_tag, custom_error_type="invalid_union",
                  custom_error_message="must be a string, an array of strings, an array of token ids or an array of "
                                       "arrays of token ids"),
]
TextsArg = Annotated[
    Annotated[str, Tag("@text")] | Annotated[list[str], Tag("@texts"), Field(min_length=1, max_length=MAX_INPUTS)],
    Discriminator(lambda v: "@text" if isinstance(v, str) else "@texts" if isinstance(v, list) else None,
                  custom_error_type="invalid_union", custom_error_message="must be a string or an array of strings"),
]


class _Document(_Body):
    text: str


def _document_tag(value: object) -> str | None:
    return "@text" if isinstance(value, str) else "@object" if isinstance(value, dict) else None


DocumentArg = Annotated[Annotated[str, Tag("@text")] | Annotated[_Document, Tag("@object")],
                        Discriminator(_document_tag, custom_error_type="invalid_union",
                                      custom_error_message='must be a string or {"text": ...}')]


class _Common(_Body):
    """What every pooling route takes (vLLM's PoolingBasicRequestMixin)."""

    model: str | None = None
    user: str | None = Field(None, description="OpenAI's end-user id; accepted, not used.")
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, description=(
        "vLLM's: keep each input's last this many tokens (-1: the model's context length)."))
    priority: Int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)


class EmbeddingRequest(_Common):
    """``POST /v1/embeddings`` (OpenAI's, with vLLM's extras)."""

    input: InputArg
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Int | None = Field(None, ge=1, description="Matryoshka models only, a size they were trained for.")
    add_special_tokens: bool | None = None
    normalize: bool | None = Field(None, description="vLLM's (older name of use_activation).")
    use_activation: bool | None = Field(None, description="vLLM's: normalise the embedding (the model's default).")
    embed_dtype: Literal["float32", "float16", "bfloat16"] | None = Field(None, description="base64's element type.")
    endianness: Literal["native", "little", "big"] | None = Field(None, description="base64's byte order.")


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``POST /pooling``: the model's raw pooled output for ``task``."""

    task: Literal["embed", "token_embed", "classify"] | None = None


class ClassificationRequest(_Common):
    """vLLM's ``POST /classify``."""

    input: InputArg
    add_special_tokens: bool | None = None
    activation: bool | None = Field(None, description="vLLM's (older name of use_activation).")
    use_activation: bool | None = Field(None, description="Apply the model's activation (softmax); default true.")


class ScoreRequest(_Common):
    """vLLM's ``POST /score``: ``text_1``/``text_2``, or ``queries`` with ``documents`` (or ``items``), or
    ``data_1``/``data_2``; one first text is scored against every second, else pairwise."""

    text_1: TextsArg | None = None
    text_2: TextsArg | None = None
    queries: TextsArg | None = None
    documents: TextsArg | None = None
    items: TextsArg | None = None
    data_1: TextsArg | None = None
    data_2: TextsArg | None = None
    activation: bool | None = None
    use_activation: bool | None = None


class RerankRequest(_Common):
    """vLLM's ``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``): Jina's and Cohere's shape."""

    query: str
    documents: list[DocumentArg] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: Int | None = Field(None, ge=0, description="The best this many (0 or absent: all).")
    return_documents: bool | None = Field(None, description="Jina's and Cohere's: include each document (default "
                                                            "true, as vLLM).")
    activation: bool | None = None
    use_activation: bool | None = None


# ---- refusals -------------------------------------------------------------------------------------------------------

def _no(name: str, instead: str = "") -> Refusal:
    return Refusal(f"`{name}` is not supported{instead}.")


_CHAT = {name: _no(name, " on the pooling routes (chat inputs); send `input`")
         for name in ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                      "chat_template_kwargs", "media_io_kwargs")}
_COMMON: dict[str, Refusal] = {
    "request_id": _no("request_id", "; send the `X-Request-Id` header"),
    "mm_processor_kwargs": _no("mm_processor_kwargs", " (text models only)"),
    "cache_salt": _no("cache_salt", " on the pooling routes"),
    "truncation_side": Refusal('`truncation_side` can only be "left": truncate_prompt_tokens keeps the last tokens.',
                               ("left",)),
    "padding": Refusal('`padding` can only be "do_not_pad".', ("do_not_pad",)),
}
EMBEDDING_REFUSED = {**_COMMON, **_CHAT}
CLASSIFY_REFUSED = {**_COMMON, **_CHAT}
SCORE_REFUSED = dict(_COMMON)
RERANK_REFUSED = {**_COMMON, "max_tokens_per_doc": _no("max_tokens_per_doc", "; use `truncate_prompt_tokens`"),
                  "rank_fields": _no("rank_fields", "; send `documents` as strings or {\"text\": ...}"),
                  "max_chunks_per_doc": _no("max_chunks_per_doc")}

_M = TypeVar("_M", bound=BaseModel)


def _parse(model: type[_M], body: Mapping[str, object], refused: Mapping[str, Refusal]) -> _M:
    refuse(body, refused)
    log_unknown(body, declared(model) | refused.keys())
    return validate(model, body)


# ---- parsed requests ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Embed:
    model: str | None
    inputs: tuple[PoolingInput, ...]
    options: PoolingOptions
    dimensions: int | None
    base64: bool
    embed_dtype: str
    endianness: str
    task: str | None = "embed"  # /pooling: None until the model's tasks decide


@dataclass(frozen=True)
class Classify:
    model: str | None
    inputs: tuple[PoolingInput, ...]
    options: PoolingOptions


@dataclass(frozen=True)
class Score:
    model: str | None
    queries: tuple[str, ...]
    documents: tuple[str, ...]
    options: PoolingOptions
    top_n: int = 0  # rerank: the best this many; 0: all
    return_documents: bool = True


def _inputs(value: str | list[int] | list[str] | list[list[int]]) -> tuple[PoolingInput, ...]:
    if isinstance(value, str):
        return (PoolingInput(text=value),)
    items: list[PoolingInput] = []
    for v in value:
        if isinstance(v, int):  # one array of token ids
            return (PoolingInput(token_ids=tuple(value)),)  # type: ignore[arg-type]
        items.append(PoolingInput(text=v) if isinstance(v, str) else PoolingInput(token_ids=tuple(v)))
    return tuple(items)


def _one_of(a: bool | None, b: bool | None, names: tuple[str, str]) -> bool | None:
    if a is not None and b is not None and a != b:
        raise bad_request(names[1], f"`{names[0]}` and `{names[1]}` are the same setting; they disagree.")
    return a if a is not None else b


def _options(req: _Common, max_model_len: int | None, *, add_special_tokens: bool | None = None,
             activation: bool | None = None) -> PoolingOptions:
    keep = req.truncate_prompt_tokens
    if keep == 0:
        raise bad_request("truncate_prompt_tokens", "`truncate_prompt_tokens` must be -1 (the model's context "
                                                    "length) or at least 1.")
    if keep == -1:
        keep = max_model_len
    return PoolingOptions(keep, add_special_tokens, req.priority or 0, activation)


def parse_embedding(body: Mapping[str, object], max_model_len: int | None, *, pooling: bool = False) -> Embed:
    req = _parse(PoolingRequest if pooling else EmbeddingRequest, body, EMBEDDING_REFUSED)
    normalize = _one_of(req.normalize, req.use_activation, ("normalize", "use_activation"))
    options = _options(req, max_model_len, add_special_tokens=req.add_special_tokens, activation=normalize)
    task = req.task if isinstance(req, PoolingRequest) else "embed"
    return Embed(req.model, _inputs(req.input), options, req.dimensions, req.encoding_format == "base64",
                 req.embed_dtype or "float32", req.endianness or "native", task)


def parse_classify(body: Mapping[str, object], max_model_len: int | None) -> Classify:
    req = _parse(ClassificationRequest, body, CLASSIFY_REFUSED)
    activation = _one_of(req.activation, req.use_activation, ("activation", "use_activation"))
    return Classify(req.model, _inputs(req.input),
                    _options(req, max_model_len, add_special_tokens=req.add_special_tokens, activation=activation))


_SCORE_NAMES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


def parse_score(body: Mapping[str, object], max_model_len: int | None) -> Score:
    req = _parse(ScoreRequest, body, SCORE_REFUSED)
    given = [(a, b) for a, b in _SCORE_NAMES if getattr(req, a) is not None and getattr(req, b) is not None]
    if len(given) != 1 or (req.documents is not None and req.items is not None):
        raise bad_request("text_1", "Send the texts to score as `text_1` and `text_2` (or `queries` with "
                                    "`documents`, or `data_1` and `data_2`), one pair of them.")
    first_name, second_name = given[0]
    first, second = getattr(req, first_name), getattr(req, second_name)
    queries = (first,) if isinstance(first, str) else tuple(first)
    documents = (second,) if isinstance(second, str) else tuple(second)
    if len(queries) not in (1, len(documents)):
        raise bad_request(first_name, f"`{first_name}` must hold one text or as many as `{second_name}` "
                                      f"({len(documents)}), got {len(queries)}.")
    activation = _one_of(req.activation, req.use_activation, ("activation", "use_activation"))
    return Score(req.model, queries, documents, _options(req, max_model_len, activation=activation))


def parse_rerank(body: Mapping[str, object], max_model_len: int | None) -> Score:
    req = _parse(RerankRequest, body, RERANK_REFUSED)
    documents = tuple(d if isinstance(d, str) else d.text for d in req.documents)
    activation = _one_of(req.activation, req.use_activation, ("activation", "use_activation"))
    return Score(req.model, (req.query,), documents, _options(req, max_model_len, activation=activation),
                 top_n=req.top_n or 0, return_documents=req.return_documents is not False)
