"""Request-supplied chat templates (``--trust-request-chat-template``), rendered in child processes.

Jinja's sandbox stops code execution, not cost: a loop over a list with an empty body makes no call and
writes nothing, so no hook in the template environment sees it, and one C call (``'x' * 10**10``,
``'x'|center(10**10)``, ``10**10**8``) runs to its end without returning to Python. Only the process doing
the work can be stopped for sure, so children render request templates: one killed when it passes the time
limit, its address space capped so an allocation fails inside it instead of swapping the host, its output
bounded chunk by chunk as the template writes it. A small pool of children renders concurrently, so one
client's slow templates hold at most the children they run in; a render waits for a free child at most the
time limit, then is refused as busy (RESOURCE_EXHAUSTED, 429), never queued behind other clients' work without
bound. Requests and replies travel as one JSON line each (no pickle across the boundary). A child loads only
the chat template module (by its path, not through ``engine/__init__``, which imports torch): it starts in a
fraction of a second, so replacing a killed one costs the next render almost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.errors import InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)

_READY = b'{"ready": true}\n'
_START_TIMEOUT_S = 30.0  # a loaded host; the render's own time limit starts after
_LINE_LIMIT = 256 * 2**20  # the longest reply line read (the renderer's output bound keeps replies below it)
DEFAULT_WORKERS = 16  # children rendering at once; each capped at memory_bytes of address space
_CHAT_MODULE = Path(__file__).resolve().parents[2] / "engine" / "text" / "chat.py"

_Process = asyncio.subprocess.Process


class TemplateWorker:
    """Up to ``workers`` child processes, each rendering one template at a time within ``timeout_s``; idle
    children are kept for the next render, a child that fails or passes the limit is killed."""

    def __init__(self, *, timeout_s: float, memory_bytes: int, workers: int = DEFAULT_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, not {workers}")
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.workers = workers
        self._idle: list[_Process] = []
        self._busy: set[_Process] = set()
        self._slots: asyncio.Semaphore | None = None  # made in the event loop that renders

    async def render(self, template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                     special_tokens: Mapping[str, str | None], kwargs: Mapping[str, Any],
                     max_output_chars: int) -> str:
        line = json.dumps({"template": template, "messages": list(messages),
                           "add_generation_prompt": add_generation_prompt, "special_tokens": dict(special_tokens),
                           "kwargs": dict(kwargs), "max_output_chars": max_output_chars},
                          ensure_ascii=False).encode() + b"\n"
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except TimeoutError:
            raise QueueFullError(f"every chat template renderer ({self.workers}) stayed busy for "
                                 f"{self.timeout_s:g} s; try again") from None
        try:
            reply = await self._render_in_child(line)
        finally:
            self._slots.release()
        if "error" in reply:
            raise InvalidRequestError(reply["field"], reply["error"])
        text: str = reply["text"]
        return text

    async def _render_in_child(self, line: bytes) -> dict[str, Any]:
        proc = await self._take()
        self._busy.add(proc)
        reusable = False
        try:
            assert proc.stdin is not None
            proc.stdin.write(line)
            reply = await asyncio.wait_for(self._reply(proc), self.timeout_s)
            reusable = True
            return reply
        except TimeoutError:
            raise InvalidRequestError("chat_template", f"the chat template did not render within "
                                                       f"{self.timeout_s:g} s") from None
        except (ConnectionError, EOFError, ValueError) as e:  # died (out of memory) or wrote no reply of ours
            raise InvalidRequestError("chat_template", "the chat template could not be rendered within the "
                                                       "memory limit") from e
        finally:  # a render cut short (a timeout, a cancelled call) leaves its child mid-template: never reused
            self._busy.discard(proc)
            if reusable and proc.returncode is None:
                self._idle.append(proc)
            else:
                await _end(proc)

    async def _take(self) -> _Process:
        """An idle live child, or a new one."""
        while self._idle:
            proc = self._idle.pop()
            if proc.returncode is None:
                return proc
            await _end(proc)
        return await self._start()

    @staticmethod
    async def _reply(proc: _Process) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        if not line:
            raise EOFError("the template worker exited")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def _start(self) -> _Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.tokenizer.template_worker", str(self.memory_bytes), str(_CHAT_MODULE),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=_LINE_LIMIT)
        assert proc.stdout is not None
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)
        except BaseException:
            await _end(proc)
            raise
        if ready != _READY:
            await _end(proc)
            raise RuntimeError(f"the chat template worker did not start (it wrote {ready[:200]!r})")
        return proc

    async def close(self) -> None:
        procs, self._idle = [*self._idle, *self._busy], []
        self._busy.clear()
        for proc in procs:
            await _end(proc)

    def kill(self) -> None:
        """Ends the children now (the service is closing; a render in flight fails)."""
        procs, self._idle = [*self._idle, *self._busy], []
        self._busy.clear()
        for proc in procs:
            _kill(proc)


def _kill(proc: _Process) -> None:
    """SIGKILL, unless the child is gone already (asyncio raises ProcessLookupError once it has reaped it)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


async def _end(proc: _Process) -> None:
    _kill(proc)
    await proc.wait()


def _load_chat_module(path: str) -> Any:
    """``engine/text/chat.py`` loaded on its own (it imports only jinja2 and ``common.errors``)."""
    spec = importlib.util.spec_from_file_location("_sluice_template_chat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _serve(memory_bytes: int, chat_module: str) -> None:
    """The child: one JSON request per stdin line, one JSON reply per stdout line, until stdin closes."""
    import resource

    renderer = _load_chat_module(chat_module).ChatTemplateRenderer()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out = sys.stdout.buffer
    out.write(_READY)
    out.flush()
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            text = renderer.render(req["template"], req["messages"], add_generation_prompt=req["add_generation_prompt"],
                                   special_tokens=req["special_tokens"], max_output_chars=req["max_output_chars"],
                                   **req["kwargs"])
            reply: dict[str, Any] = {"text": text}
        except InvalidRequestError as e:
            reply = {"field": e.field, "error": e.message}
        except MemoryError:
            reply = {"field": "chat_template", "error": "the chat template could not be rendered within the "
                                                        "memory limit"}
        except RecursionError:
            reply = {"field": "chat_template", "error": "the chat template recursed too deeply"}
        except Exception as e:  # noqa: BLE001 - any failure of the client's template is the client's error
            reply = {"field": "chat_template", "error": f"the chat template failed: {e!r}"}
        out.write(json.dumps(reply, ensure_ascii=False).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
