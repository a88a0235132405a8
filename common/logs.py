"""Process logging: vLLM-like text lines, or JSON lines (``--log-format json``) carrying the id of the request
being served.

The request id lives in a contextvar that each process sets where it starts serving a request (the gateway's
request middleware, the tokenizer service's and the engine's request handlers); a filter copies it onto every
record logged in that context, so a line logged deep in a call path carries it without being passed down. Code
that logs for a request outside its context (a step's outputs handled for many requests at once) passes it as
``extra={"request_id": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")

REQUEST_ID: ContextVar[str | None] = ContextVar("sluice_request_id", default=None)


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged inside carry ``request_id``."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` from the context, unless the call gave one (``extra``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, process (``gateway``,
    ``tokenizer``, ``engine``...), request_id when there is one, and a traceback as ``exc_info``."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": self._process,
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            line["request_id"] = request_id
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str, process: str) -> None:
    """The root logger's one handler, on stderr: ``text`` keeps the format the processes always had,
    ``json`` writes :class:`JsonFormatter` lines (Python warnings included)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process))
        logging.captureWarnings(True)
        # Progress bars (weight loading) are not log lines. tqdm reads this when first imported, which in every
        # process of the stack is later than this; the children of `sluice serve` inherit it.
        os.environ.setdefault("TQDM_DISABLE", "1")
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {process}: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
