"""Chat templates: Jinja2 in a sandbox, rendered the way Hugging Face transformers renders them.

Templates come from model files or from requests, so they are untrusted code: they run in
jinja2's ImmutableSandboxedEnvironment, with only the helpers transformers gives them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidRequestError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Compiled templates kept per renderer: a model has one or two; request templates (when trusted) are
# each client's own, so an unbounded cache would grow with every distinct template sent.
COMPILE_CACHE_SIZE = 64


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which changes prompts; transformers overrides it the same way.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplateRenderer:
    """Compiles templates once (per renderer, the last ``cache_size`` kept) and renders validated messages
    with them."""

    def __init__(self, cache_size: int = COMPILE_CACHE_SIZE) -> None:
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = _strftime_now
        self._cache_size = cache_size
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()

    @property
    def cached(self) -> list[str]:
        """The templates compiled and kept, least recently used first."""
        return list(self._compiled)

    def compile(self, template: str) -> jinja2.Template:
        compiled = self._compiled.get(template)
        if compiled is not None:
            self._compiled.move_to_end(template)
            return compiled
        try:
            compiled = self._env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise InvalidRequestError("chat_template", f"the chat template does not parse: {e}") from e
        self._compiled[template] = compiled
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return compiled

    def render(self, template: str | None, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               special_tokens: Mapping[str, str | None], max_output_chars: int | None = None, **kwargs: Any) -> str:
        """``max_output_chars``: the rendering stops (InvalidRequestError naming ``chat_template``) as soon as
        its output passes this many characters, checked chunk by chunk as the template writes them."""
        if template is None:
            raise InvalidRequestError(
                "chat_template", "this model has no chat template; pass one (chat_template) or send a plain prompt")
        compiled = self.compile(template)
        context = {**{k: v for k, v in special_tokens.items() if v is not None}, **kwargs}
        try:
            chunks = compiled.generate(messages=normalize_messages(messages),
                                       add_generation_prompt=add_generation_prompt, **context)
            return _bounded_concat(chunks, max_output_chars)
        except InvalidRequestError:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError("messages", f"the chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # A template indexing a field the messages lack, or concatenating a non-string.
            raise InvalidRequestError("messages", f"the chat template failed on these messages: {e!r}") from e


def _bounded_concat(chunks: Any, max_chars: int | None) -> str:
    if max_chars is None:
        return "".join(chunks)
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_chars:
            raise InvalidRequestError("chat_template", f"the chat template's output passes {max_chars} characters")
        out.append(chunk)
    return "".join(out)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated copies of OpenAI-style messages, with text-part content joined into one string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages", "must be a list of {role, content} objects")
    if not messages:
        raise InvalidRequestError("messages", "must not be empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError("messages", f"messages[{i}] is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError("messages", f"messages[{i}] has unknown role {role!r} "
                                                  f"(expected one of {', '.join(sorted(ROLES))})")
        copy = dict(message)
        content = message.get("content")
        if content is None:
            # An assistant turn that only calls tools may have no content (OpenAI allows null there).
            if not (role == "assistant" and message.get("tool_calls")):
                raise InvalidRequestError("messages", f"messages[{i}] ({role}) has no content")
        else:
            copy["content"] = _content_text(content, i)
        if message.get("tool_calls"):
            copy["tool_calls"] = _tool_calls(message["tool_calls"], i)
        out.append(copy)
    return out


def _tool_calls(calls: Any, index: int) -> list[Any]:
    """Copies of an assistant turn's calls with JSON-text arguments parsed: templates write them with
    ``tojson`` or iterate over them (as vLLM passes them)."""
    if not isinstance(calls, list):
        raise InvalidRequestError("messages", f"messages[{index}].tool_calls must be a list")
    out: list[Any] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError as e:
                raise InvalidRequestError("messages", f"messages[{index}].tool_calls[{j}].function.arguments "
                                                      f"is not valid JSON: {e}") from e
            if not isinstance(arguments, dict):
                raise InvalidRequestError("messages", f"messages[{index}].tool_calls[{j}].function.arguments "
                                                      "must be a JSON object")
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def load_chat_template(value: str) -> str:
    """A ``--chat-template`` value: a file's path, or the template itself (as vLLM reads the flag)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a long inline template is not a valid path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and it does not look like a template")


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("messages", f"messages[{index}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                "messages", f"messages[{index}].content[{j}] is not a text part ({kind!r}); only text is supported")
        texts.append(part["text"])
    # Parts are joined with newlines, as vLLM does for templates that expect string content.
    return "\n".join(texts)
