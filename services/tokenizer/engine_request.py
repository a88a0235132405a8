"""The public request's options checked (the cheap checks; the engine checks the rest) and turned into the
engine request's, prompt aside."""

from __future__ import annotations

import functools
import json

from common.errors import InvalidRequestError
from engine.text import Tokenizer
from engine.text.bad_words import bad_words_token_ids, check_bad_words
from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2

_MAX_STOP_STRINGS = 16
_MAX_STOP_LEN = 256
_MAX_TOP_LOGPROBS = 20
_MAX_GUIDED_BYTES = 64 * 1024
# Most sequences one request may ask for (n, best_of, beam width), as the REST gateway's --max-n default: each is
# a running seat, its KV blocks and a detokenizer here. Checked here because every API passes through here.
MAX_SEQUENCES = 16


def check_options(request: generation_pb2.GenerateRequest) -> None:
    stop = request.stopping.stop
    if len(stop) > _MAX_STOP_STRINGS or any(len(s) > _MAX_STOP_LEN or not s for s in stop):
        raise InvalidRequestError("stop", f"at most {_MAX_STOP_STRINGS} non-empty stop strings of at most "
                                          f"{_MAX_STOP_LEN} characters")
    response = request.response
    if response.top_logprobs > _MAX_TOP_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in [0, {_MAX_TOP_LOGPROBS}]")
    if response.HasField("prompt_logprobs") and response.prompt_logprobs > _MAX_TOP_LOGPROBS:
        raise InvalidRequestError("prompt_logprobs", f"must be in [0, {_MAX_TOP_LOGPROBS}]")
    if response.HasField("stream_interval") and response.stream_interval < 1:
        raise InvalidRequestError("stream_interval", "must be an integer >= 1")
    if response.echo and request.WhichOneof("input") == "chat":
        raise InvalidRequestError("echo", "needs a text or token-id prompt (the gateway echoes chat messages)")
    n = request.n or 1
    width = request.beam_search.beam_width if request.HasField("beam_search") else 0
    for name, value in (("n", n), ("best_of", request.best_of), ("beam_width", width)):
        if value > MAX_SEQUENCES:
            raise InvalidRequestError(name, f"must be at most {MAX_SEQUENCES}, got {value}")
    if request.best_of and request.best_of < n:
        raise InvalidRequestError("best_of", f"must be at least n ({n}), got {request.best_of}")
    if width and width < n:
        raise InvalidRequestError("beam_width", f"must be at least n ({n}), got {width}")
    check_guided(request.guided)
    check_bad_words(request.bad_words)


def check_guided(guided: common_pb2.GuidedDecoding) -> None:
    kind = guided.WhichOneof("kind")
    if kind == "choice":
        choices = guided.choice.choices
        if not choices:
            raise InvalidRequestError("choice", "needs at least one string")
        size = sum(len(c.encode()) for c in choices)
    elif kind in ("json_schema", "regex", "grammar"):
        value: str = getattr(guided, kind)
        if not value:
            raise InvalidRequestError(kind, "is empty")
        size = len(value.encode())
    else:
        return
    if size > _MAX_GUIDED_BYTES:
        raise InvalidRequestError(kind, f"is {size} bytes; at most {_MAX_GUIDED_BYTES}")
    if kind == "json_schema":
        try:
            schema = json.loads(guided.json_schema)
        except ValueError as e:
            raise InvalidRequestError("json_schema", f"is not JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("json_schema", "must be a JSON schema (an object)")


def engine_options(request: generation_pb2.GenerateRequest, request_id: str, n: int,
                   guided: common_pb2.GuidedDecoding | None, lora_adapter: str = ""
                   ) -> engine_pb2.EngineGenerateRequest:
    """Everything of the engine request but the prompt; ``guided`` (tool_choice's) replaces the request's;
    ``lora_adapter``: the adapter ``request.model`` names, "" for the base model."""
    st = request.stopping
    stopping = engine_pb2.EngineStoppingCriteria(min_tokens=st.min_tokens, stop_token_ids=st.stop_token_ids,
                                                 ignore_eos=st.ignore_eos)
    if st.HasField("max_tokens"):
        stopping.max_tokens = st.max_tokens
    req = engine_pb2.EngineGenerateRequest(request_id=request_id, sampling=request.sampling, stopping=stopping,
                                           priority=request.priority, n=n, best_of=request.best_of,
                                           lora_adapter=lora_adapter, cache_salt=request.cache_salt)
    response = request.response
    if response.logprobs:
        req.logprobs = response.top_logprobs
    if response.HasField("stream_interval"):
        req.stream_interval = response.stream_interval
    prompt_logprobs = prompt_logprobs_asked(response)
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    if guided is not None:
        req.guided.CopyFrom(guided)
    elif request.HasField("guided"):
        req.guided.CopyFrom(request.guided)
    if request.HasField("beam_search"):
        req.beam_search.CopyFrom(request.beam_search)
    return req


def bad_words_to_pb(words: list[str], tokenizer: Tokenizer) -> list[common_pb2.TokenIds]:
    """The request's bad words as the engine bans them: each tokenized bare and after a space (vLLM's rule)."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    return [common_pb2.TokenIds(ids=ids) for ids in bad_words_token_ids(words, encode)]


def prompt_logprobs_asked(response: generation_pb2.ResponseOptions) -> int | None:
    """How many alternatives per prompt token to ask for: prompt_logprobs, or echo with logprobs (its
    top_logprobs, the completion API's prompt logprobs), the larger of the two when both; None: none."""
    asked = [response.prompt_logprobs] if response.HasField("prompt_logprobs") else []
    if response.echo and response.logprobs:
        asked.append(response.top_logprobs)
    return max(asked) if asked else None
