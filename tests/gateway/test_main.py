"""``python -m gateway`` flags become one GatewaySettings; auth and request-id helpers."""

from __future__ import annotations

import pytest

from gateway.__main__ import build_parser, settings_from_args
from gateway.auth import bearer_token
from gateway.request_context import pick_request_id
from gateway.settings import GatewaySettings


def settings(argv: list[str], env: dict[str, str] | None = None) -> GatewaySettings:
    return settings_from_args(build_parser().parse_args(argv), env or {})


def test_defaults() -> None:
    s = settings([])
    assert s == GatewaySettings()
    assert s.api_keys == () and s.allowed_origins == () and s.request_timeout is None
    assert not s.tokenizer_mux  # a Generate call per request: balanced per request over a dns:/// name


def test_flags() -> None:
    s = settings(["--tokenizer", "127.0.0.1:1, 127.0.0.1:2", "--host", "0.0.0.0", "--port", "9000",
                  "--api-key", "a", "--api-key", "b", "--allowed-origins", "https://x,https://y",
                  "--served-model-name", "m", "--max-body-bytes", "100", "--request-timeout", "30",
                  "--keepalive-interval", "2", "--max-n", "4", "--shutdown-timeout", "3", "--tokenizer-mux"])
    assert s == GatewaySettings(tokenizer_addresses=("127.0.0.1:1", "127.0.0.1:2"), tokenizer_mux=True,
                                host="0.0.0.0", port=9000,
                                api_keys=("a", "b"), allowed_origins=("https://x", "https://y"),
                                served_model_names=("m",), max_body_bytes=100, request_timeout=30.0,
                                keepalive_interval=2.0, max_n=4, shutdown_timeout=3.0)


def test_vllm_cors_and_access_log_flags() -> None:
    s = settings(["--allowed-origins", "*", "--allow-credentials", "--allowed-methods", '["GET", "POST"]',
                  "--allowed-headers", "*", "--disable-uvicorn-access-log"])
    assert (s.allow_credentials, s.allowed_methods, s.allowed_headers, s.access_log) == (
        True, ("GET", "POST"), ("*",), False)
    d = settings([])
    assert (d.allow_credentials, d.access_log) == (False, True) and "POST" in d.allowed_methods
    from gateway.drain import Drain
    from gateway.server import build_server
    assert build_server(lambda *a: None, s, Drain()).config.access_log is False  # type: ignore[arg-type]


def test_origins_as_a_json_list_like_vllm() -> None:
    assert settings(["--allowed-origins", '["*"]']).allowed_origins == ("*",)
    with pytest.raises(SystemExit):
        settings(["--allowed-origins", "[1]"])


def test_api_key_from_environment_unless_given() -> None:
    assert settings([], {"SLUICE_API_KEY": "env"}).api_keys == ("env",)
    assert settings(["--api-key", "flag"], {"SLUICE_API_KEY": "env"}).api_keys == ("flag",)


@pytest.mark.parametrize("bad", [dict(keepalive_interval=0), dict(request_timeout=-1), dict(max_body_bytes=0),
                                 dict(tokenizer_addresses=()), dict(api_keys=("",)), dict(max_n=0)])
def test_invalid_settings(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GatewaySettings(**bad)  # type: ignore[arg-type]


def test_bad_flag_values_exit_with_usage() -> None:
    from gateway.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["--keepalive-interval", "-1"])
    assert info.value.code == 2


def scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


def test_bearer_token_parsing() -> None:
    assert bearer_token(scope((b"authorization", b"Bearer abc"))) == "abc"
    assert bearer_token(scope((b"authorization", b"bearer  abc "))) == "abc"
    assert bearer_token(scope((b"authorization", b"Basic abc"))) is None
    assert bearer_token(scope()) is None


def test_request_ids() -> None:
    assert pick_request_id(scope((b"x-request-id", b"req-1.a:b_c"))) == "req-1.a:b_c"
    generated = pick_request_id(scope((b"x-request-id", b"x" * 129)))
    assert len(generated) == 32 and generated != pick_request_id(scope())


def test_keepalive_comments_are_off_unless_asked() -> None:
    assert settings([]).keepalive_interval is None
    assert settings(["--keepalive-interval", "0"]).keepalive_interval is None
    assert settings(["--keepalive-interval", "0.5"]).keepalive_interval == 0.5
    assert settings([]).first_event_wait == 5.0 and settings(["--keepalive-interval", "2"]).first_event_wait == 2.0
