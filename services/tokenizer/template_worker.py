"""Request-supplied chat templates (``--trust-request-chat-template``), rendered in a child process.

Jinja's sandbox stops code execution, not cost: a loop over a list with an empty body makes no call and
writes nothing, so no hook in the template environment sees it, and one C call (``'x' * 10**10``,
``'x'|center(10**10)``, ``10**10**8``) runs to its end without returning to Python. Only the process doing
the work can be stopped for sure, so a child renders request templates: killed (and started again on the next
one) when it passes the time limit, its address space capped so an allocation fails inside it instead of
swapping the host, its output bounded chunk by chunk as the template writes it. Requests and replies travel as
one JSON line each (no pickle across the boundary).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from common.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_READY = b'{"ready": true}\n'
_START_TIMEOUT_S = 30.0  # importing jinja2 on a loaded host; the render's own time limit starts after
_LINE_LIMIT = 256 * 2**20  # the longest reply line read (the renderer's output bound keeps replies below it)


class TemplateWorker:
    """One child process; renders run one at a time, each within ``timeout_s``."""

    def __init__(self, *, timeout_s: float, memory_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def render(self, template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                     special_tokens: Mapping[str, str | None], kwargs: Mapping[str, Any],
                     max_output_chars: int) -> str:
        line = json.dumps({"template": template, "messages": list(messages),
                           "add_generation_prompt": add_generation_prompt, "special_tokens": dict(special_tokens),
                           "kwargs": dict(kwargs), "max_output_chars": max_output_chars},
                          ensure_ascii=False).encode() + b"\n"
        async with self._lock:
            proc = await self._started()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                reply = await asyncio.wait_for(self._reply(proc), self.timeout_s)
            except TimeoutError:
                await self._kill()
                raise InvalidRequestError("chat_template", f"the chat template did not render within "
                                                           f"{self.timeout_s:g} s") from None
            except (ConnectionError, EOFError, ValueError) as e:
                await self._kill()  # died (out of memory) or wrote something that is not our reply
                raise InvalidRequestError("chat_template", "the chat template could not be rendered within the "
                                                           "memory limit") from e
        if "error" in reply:
            raise InvalidRequestError(reply["field"], reply["error"])
        text: str = reply["text"]
        return text

    @staticmethod
    async def _reply(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        if not line:
            raise EOFError("the template worker exited")
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.tokenizer.template_worker", str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=_LINE_LIMIT)
        assert proc.stdout is not None
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)
        except TimeoutError:
            ready = b""
        if ready != _READY:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"the chat template worker did not start (it wrote {ready[:200]!r})")
        self._proc = proc
        return proc

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def close(self) -> None:
        async with self._lock:
            await self._kill()

    def kill(self) -> None:
        """Ends the child now (the service is closing; a render in flight fails)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()


def _serve(memory_bytes: int) -> None:
    """The child: one JSON request per stdin line, one JSON reply per stdout line, until stdin closes."""
    import resource

    from engine.text.chat import ChatTemplateRenderer

    renderer = ChatTemplateRenderer()
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
    _serve(int(sys.argv[1]))
