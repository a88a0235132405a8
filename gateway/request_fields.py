"""Every request field of the generation routes, accounted for.

A name either works (a field of the route's model in gateway/models.py) or is refused here with a 400 that
names it; tests/gateway/test_vllm_fields.py walks vLLM's and OpenAI's own field lists against the two.
A refused field may name the values that change nothing (vLLM's default, say), which are accepted.
A name neither API defines is logged once per name and otherwise ignored, as vLLM does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from gateway.errors import bad_request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    message: str
    allowed: tuple[object, ...] = ()  # values that change nothing: accepted

    def refuses(self, value: object) -> bool:
        return value is not None and not any(type(value) is type(a) and value == a for a in self.allowed)


def _no(name: str, instead: str = "") -> Refusal:
    return Refusal(f"`{name}` is not supported{instead}.")


_BOTH: dict[str, Refusal] = {
    "suffix": _no("suffix"),
    "structural_tag": _no("structural_tag", "; use `guided_grammar` or `response_format`"),
    "guided_whitespace_pattern": _no("guided_whitespace_pattern"),
    "functions": _no("functions", " (deprecated by OpenAI); use `tools`"),
    "function_call": _no("function_call", " (deprecated by OpenAI); use `tool_choice`"),
    "prompt_embeds": _no("prompt_embeds", "; send `prompt` as text or token ids"),
    "spaces_between_special_tokens": Refusal(
        "`spaces_between_special_tokens` can only be true: text is decoded by the tokenizers library, as vLLM's "
        "fast detokenizer decodes it when true.", (True,)),
    "logits_processors": _no("logits_processors"),
    "return_tokens_as_token_ids": _no("return_tokens_as_token_ids"),
    "kv_transfer_params": _no("kv_transfer_params"),
    "vllm_xargs": _no("vllm_xargs"),
    "request_id": _no("request_id", "; send the `X-Request-Id` header"),
    "mm_processor_kwargs": _no("mm_processor_kwargs", " (text models only)"),
    # OpenAI's platform features.
    "audio": _no("audio", " (text output only)"),
    "modalities": Refusal('`modalities` can only be ["text"].', (["text"],)),
    "prediction": _no("prediction"),
    "web_search_options": _no("web_search_options"),
    "store": Refusal("`store` can only be false: responses are not stored.", (False,)),
    "service_tier": Refusal('`service_tier` can only be "auto" or "default".', ("auto", "default")),
    "verbosity": _no("verbosity"),
    "moderation": _no("moderation"),
    "prompt_cache_retention": _no("prompt_cache_retention"),
    "prompt_cache_options": _no("prompt_cache_options"),
}
# Chat's fields, refused by completions.
_CHAT_ONLY = {"tools": "", "tool_choice": "", "top_logprobs": " (completions take `logprobs`, an integer)",
              "thinking_token_budget": ""}

COMPLETION_REFUSED: dict[str, Refusal] = {
    **_BOTH,
    **{name: Refusal(f"`{name}` is for /v1/chat/completions{hint}.") for name, hint in _CHAT_ONLY.items()},
}
CHAT_REFUSED: dict[str, Refusal] = {
    **_BOTH,
    "continue_final_message": Refusal(
        "`continue_final_message` is not supported; end `messages` with an assistant turn and set `echo`.",
        (False,)),
    "documents": _no("documents"),
}

_logged_unknown: set[str] = set()  # names logged so far: each once per process
_MAX_LOGGED = 256  # a client sending made-up names cannot grow the set without bound


def declared(model: type[BaseModel]) -> frozenset[str]:
    """The names ``model`` reads: its fields and their aliases."""
    return frozenset(n for name, f in model.model_fields.items() for n in (name, f.alias) if n is not None)


def refuse(body: Mapping[str, object], refused: Mapping[str, Refusal]) -> None:
    for name, refusal in refused.items():
        if refusal.refuses(body.get(name)):
            raise bad_request(name, refusal.message)


def log_unknown(body: Mapping[str, object], known: frozenset[str]) -> None:
    """Names neither API defines are ignored, as vLLM does; each is logged the first time it is seen."""
    for name in sorted(body.keys() - known):
        shown = name[:64]
        if shown in _logged_unknown or len(_logged_unknown) >= _MAX_LOGGED:
            continue
        _logged_unknown.add(shown)
        log.warning("request field %r is not a known field: ignored", shown)
