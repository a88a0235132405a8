"""common/logs.py: JSON lines that parse, with the request id inside a request's context and not outside."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from common.logs import JsonFormatter, RequestIdFilter, configure_logging, request_context
from tests.procs import ROOT


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter("gateway"))
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_lines_in_a_request_context_carry_its_id_and_others_none(json_log: tuple[logging.Logger, io.StringIO]
                                                                 ) -> None:
    log, stream = json_log
    log.info("starting")
    with request_context("req-1"):
        log.warning("inside %s", "the request")
    log.info("after")
    log.info("for another", extra={"request_id": "req-2"})
    first, inside, after, explicit = _records(stream)
    assert "request_id" not in first and "request_id" not in after
    assert inside["request_id"] == "req-1"
    assert explicit["request_id"] == "req-2"
    assert inside["message"] == "inside the request"
    assert (inside["level"], inside["logger"], inside["process"]) == ("WARNING", "test.logs", "gateway")
    assert str(inside["time"]).endswith("+00:00")


def test_concurrent_requests_keep_their_own_ids(json_log: tuple[logging.Logger, io.StringIO]) -> None:
    """The id is a contextvar: tasks interleaving on one loop never see each other's."""
    log, stream = json_log

    async def serve(request_id: str) -> None:
        with request_context(request_id):
            for step in range(3):
                log.info("%s step %d", request_id, step)
                await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(serve("a"), serve("b"))

    asyncio.run(main())
    records = _records(stream)
    assert len(records) == 6
    assert [r["request_id"] for r in records] != sorted(r["request_id"] for r in records)  # interleaved
    for record in records:
        assert str(record["message"]).startswith(f"{record['request_id']} step")


def test_tracebacks_stay_inside_the_line(json_log: tuple[logging.Logger, io.StringIO]) -> None:
    log, stream = json_log
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        log.exception("failed")
    (record,) = _records(stream)
    assert record["message"] == "failed"
    assert "ValueError: bad" in str(record["exc_info"])


def test_configure_logging_makes_every_line_json_warnings_included() -> None:
    script = """
        import logging, warnings
        from common.logs import configure_logging, request_context
        configure_logging("info", "json", "engine")
        logging.getLogger("x").info("plain")
        with request_context("r9"):
            logging.getLogger("y").debug("hidden at info")
            warnings.warn("careful")
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/", "1.1", 200)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stderr.splitlines()]
    assert [r["logger"] for r in records] == ["x", "py.warnings", "uvicorn.access"]
    assert records[1]["request_id"] == "r9" and "careful" in records[1]["message"]
    assert {r["process"] for r in records} == {"engine"}


def test_unknown_log_formats_are_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml", "engine")
