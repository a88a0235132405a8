"""A request's prompt built into token ids with bounded work: sizes checked first, tokenizing and rendering
off the event loop, request chat templates only when trusted and then in the template worker."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from common.errors import InvalidRequestError
from engine.text import Tokenizer
from proto.sluice.v1 import generation_pb2
from services.tokenizer.chat import chat_inputs
from services.tokenizer.limits import InputLimits, check_chat, check_text, check_token_ids, max_prompt_chars
from services.tokenizer.template_worker import TemplateWorker

_T = TypeVar("_T")


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, limits: InputLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # `tokenizers` releases the GIL while it encodes: one long prompt never stalls other streams.
        self._pool = ThreadPoolExecutor(limits.tokenize_threads, thread_name_prefix="tokenize")
        self._template_worker = (TemplateWorker(timeout_s=limits.template_timeout_s,
                                                memory_bytes=limits.template_memory_bytes)
                                 if limits.trust_request_chat_template else None)

    def max_chars(self, max_model_len: int) -> int:
        return max_prompt_chars(max_model_len, self.tokenizer.max_token_bytes,
                                normalized=self.tokenizer.backend.normalizer is not None)

    async def prompt_ids(self, request: generation_pb2.GenerateRequest, max_model_len: int
                         ) -> list[int] | np.ndarray:
        """The prompt's token ids: text encoded, chat messages rendered with the chat template and
        encoded, or the given ids as an array; an empty or missing prompt, or one that cannot fit in
        ``max_model_len`` by its size alone, is an InvalidRequestError (refused before any tokenizing).
        With ``truncate_prompt_tokens`` only the last that many are kept (vLLM's), before the length check."""
        keep = request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
        if keep is not None and not 1 <= keep <= max_model_len:
            raise InvalidRequestError("truncate_prompt_tokens", f"must be in [1, max_model_len ({max_model_len})], "
                                                                f"got {keep}")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
        which = request.WhichOneof("input")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt", "the prompt is empty")
            ids: list[int] | np.ndarray = await self.encode("prompt", request.text, max_model_len,
                                                            add_special_tokens=add_special is not False)
        elif which == "chat":
            text = await self.render(request.chat, max_model_len)
            ids = await self.off_loop(self.tokenizer.encode, text, add_special_tokens=add_special is True)
        elif which == "token_ids":
            count = len(request.token_ids.ids)
            check_token_ids("prompt", count if keep is None else min(count, keep), max_model_len)
            # Kept as an array (upb's repeated field exports __array__: 47 µs for 128k ids): it goes into
            # the shared-memory ring with one memcpy and the engine keeps it as is, no Python ints on the way.
            ids = np.asarray(request.token_ids.ids)
        else:
            raise InvalidRequestError("prompt", "one of text, chat or token_ids is required")
        if len(ids) == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        return ids if keep is None or len(ids) <= keep else ids[-keep:]

    async def encode(self, field: str, text: str, max_model_len: int, *, add_special_tokens: bool) -> list[int]:
        """``text`` (the request's ``field``) encoded, refused unread when it is too long to fit."""
        check_text(field, text, self.max_chars(max_model_len))
        return await self.off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def render(self, chat: generation_pb2.Chat, max_model_len: int) -> str:
        """The chat's prompt text, its inputs and its output bounded by the prompt size limit. The model's
        (or the service's) template renders in a thread; a request's own only with
        --trust-request-chat-template, in the template worker (bounded in time and memory)."""
        max_chars = self.max_chars(max_model_len)
        check_chat(chat, max_chars)
        inputs = chat_inputs(chat)
        if inputs.request_template is None:
            return await self.off_loop(self.tokenizer.apply_chat_template, inputs.messages,
                                       add_generation_prompt=inputs.add_generation_prompt,
                                       max_output_chars=max_chars, **inputs.kwargs)
        if self._template_worker is None:
            raise InvalidRequestError("chat_template", "request chat templates are not allowed on this server; "
                                                       "start it with --trust-request-chat-template to allow them")
        return await self._template_worker.render(
            inputs.request_template, inputs.messages, add_generation_prompt=inputs.add_generation_prompt,
            special_tokens=self.tokenizer.special_tokens(), kwargs=inputs.kwargs, max_output_chars=max_chars)

    async def off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._template_worker is not None:
            self._template_worker.kill()

    async def aclose(self) -> None:
        """``close``, waiting for the template worker to exit (from inside the event loop that started it)."""
        if self._template_worker is not None:
            await self._template_worker.close()
        self.close()
