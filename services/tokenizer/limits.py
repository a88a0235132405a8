"""Bounds on the work one request may cause in the tokenizer service, checked before any of it is done.

A prompt is refused by its length alone (O(1): ``len`` of a str) when it cannot fit in ``max_model_len``
tokens whatever it says: a token stands for at most ``Tokenizer.max_token_bytes`` bytes (81 for
SmolLM2: a newline and 80 spaces) and a character is at least one byte, so a text of more than
``max_model_len × max_token_bytes`` characters has more than ``max_model_len`` tokens. The bound is doubled
when the tokenizer has a normalizer (NFC/NFKC composition may shorten text before tokens are matched). Texts
under the bound are tokenized (off the event loop) and the engine checks their exact length.

The same bound, in bytes (each token stands for at most ``max_token_bytes`` bytes of UTF-8), sizes the public
gRPC API's receive limit, so that a message too big to hold a prompt that fits is refused by gRPC unread.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidRequestError
from common.grpc_server import MESSAGE_HEADROOM_BYTES
from proto.sluice.v1 import generation_pb2

# Room for a normalizer that shortens text before tokens are matched (see the module's doc).
NORMALIZER_SLACK = 2


@dataclass(frozen=True)
class InputLimits:
    """The tokenizer service's settings for untrusted input (one per process, from its flags)."""

    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    template_timeout_s: float = 1.0  # a request's template renders within this, or is refused
    template_memory_bytes: int = 2 * 2**30  # the address space of the process that renders request templates
    tokenize_threads: int = 4  # threads that tokenize and render off the event loop

    def __post_init__(self) -> None:
        if self.template_timeout_s <= 0:
            raise ValueError(f"template_timeout_s must be > 0, not {self.template_timeout_s}")
        if self.tokenize_threads < 1:
            raise ValueError(f"tokenize_threads must be >= 1, not {self.tokenize_threads}")


def max_prompt_chars(max_model_len: int, max_token_bytes: int, *, normalized: bool) -> int:
    """The most characters a prompt (or a chat's text, or a rendered template) may have."""
    return max_model_len * max_token_bytes * (NORMALIZER_SLACK if normalized else 1)


def max_message_bytes(max_model_len: int, max_token_bytes: int, *, normalized: bool) -> int:
    """The public API's receive limit: the longest prompt that can fit, as text (``max_prompt_chars``, which
    bounds its UTF-8 bytes too) or as ids (at most 5 bytes each on the wire), and room for the other fields."""
    return max(max_prompt_chars(max_model_len, max_token_bytes, normalized=normalized),
               max_model_len * 5) + MESSAGE_HEADROOM_BYTES


def check_text(field: str, text: str, max_chars: int) -> None:
    check_length(field, len(text), max_chars)


def check_length(field: str, length: int, max_chars: int) -> None:
    """``field``'s text, ``length`` characters in all, within ``max_chars``."""
    if length > max_chars:
        raise InvalidRequestError(field, f"is {length} characters; at most {max_chars} can fit in the model's "
                                         "context (max_model_len × the longest token's bytes)")


def check_token_ids(field: str, count: int, max_model_len: int) -> None:
    if count > max_model_len:
        raise InvalidRequestError(field, f"has {count} token ids, more than max_model_len ({max_model_len})")


def check_chat(chat: generation_pb2.Chat, max_chars: int) -> None:
    """The chat's messages, tools and template variables each within ``max_chars`` characters in all."""
    messages = sum(len(m.role) + len(m.content) + len(m.name) + len(m.tool_call_id)
                   + sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls) for m in chat.messages)
    check_length("messages", messages, max_chars)
    check_length("tools", sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools), max_chars)
    check_text("chat_template_kwargs", chat.chat_template_kwargs, max_chars)
    if chat.HasField("chat_template"):
        check_text("chat_template", chat.chat_template, max_chars)
