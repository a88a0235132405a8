"""The top-level keys, LogConfig, and ServerConfig's listener and request keys (its TLS keys: ``https.py``)."""

from __future__ import annotations

import ipaddress
from typing import Any

from services.mindie.context import Context, Handler, constant
from services.mindie.outcome import (
    KeyRefused,
    Outcome,
    boolean,
    effect,
    integer,
    no_effect,
    string,
    valid,
)

# MindIE's maxLinkNum: that many requests in progress and twice as many queued; the next one is refused.
LINKS_PER_MAX_LINK_NUM = 3
MIB = 2**20


# -- top level ------------------------------------------------------------------------------------------------
def _version(value: Any, ctx: Context) -> Outcome:
    if value != "1.0.0":
        raise KeyRefused(f"{value!r}: MindIE's config.json has one version, \"1.0.0\"")
    return no_effect("the file format's version; MindIE has only 1.0.0")


def _dynamic_timeouts(value: Any, ctx: Context) -> Outcome:
    if boolean(value):
        return effect("inference timeouts at their maximum: ServerConfig.e2eTimeout is not applied, so no gateway "
                      "deadline")
    return no_effect("the timeouts stay as ServerConfig.e2eTimeout sets them")


def _legacy(value: Any, ctx: Context) -> Outcome:
    raise KeyRefused("MindIE 1.0.RC1/RC2's layout (OtherParam, WorkFlowParam, ModelDeployParam) is not read: write "
                     "the ServerConfig / BackendConfig layout of MindIE 1.0.RC3 and later")


TOP_KEYS: dict[str, Handler] = {
    "Version": _version,
    "EnableDynamicAdjustTimeoutConfig": _dynamic_timeouts,
    "OtherParam": _legacy, "WorkFlowParam": _legacy, "ModelDeployParam": _legacy,
}


# -- LogConfig ------------------------------------------------------------------------------------------------
# MindIE's levels (case-insensitive) -> Python's. "None" prints nothing in MindIE; critical lines are the least
# Sluice logs.
_LOG_LEVELS = {"verbose": "debug", "debug": "debug", "info": "info", "warning": "warning", "warn": "warning",
               "error": "error", "critical": "critical", "none": "critical"}


def _log_level(value: Any, ctx: Context) -> Outcome:
    level = _LOG_LEVELS.get(string(value).lower())
    if level is None:
        raise KeyRefused(f"{value!r} is not a MindIE log level ({', '.join(sorted(_LOG_LEVELS))})")
    return effect(f"log level {level} in every process", log_level=level)


def _dynamic_log_level(value: Any, ctx: Context) -> Outcome:
    if string(value):
        raise KeyRefused(f"{value!r}: a log level that changes while serving is not supported; start with the "
                         "level (LogConfig.logLevel or --log-level)")
    return no_effect("no temporary log level is set")


_STDERR = no_effect("Sluice logs to standard error; its process manager keeps and rotates the log (journald, docker, "
                    "kubectl logs)")
LOG_KEYS: dict[str, Handler] = {
    "logLevel": _log_level,
    "logFileSize": constant(_STDERR), "logFileNum": constant(_STDERR), "logPath": constant(_STDERR),
    "dynamicLogLevel": _dynamic_log_level,
    "dynamicLogLevelValidHours": constant(no_effect("only used with LogConfig.dynamicLogLevel")),
    "dynamicLogLevelValidTime": constant(no_effect("only used with LogConfig.dynamicLogLevel")),
}


# -- ServerConfig: the listener -------------------------------------------------------------------------------
def api_host(ctx: Context) -> str:
    """The address the gateways bind: MIES_CONTAINER_IP over ipAddress, as MindIE (default 127.0.0.1)."""
    return ctx.environ.get("MIES_CONTAINER_IP") or valid(string, ctx.server.get("ipAddress", "127.0.0.1")) or ""


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(address)
    except ValueError:
        raise KeyRefused(f"{address!r} is not an IPv4 or IPv6 address") from None


def _ip_address(value: Any, ctx: Context) -> Outcome:
    given = string(value)
    host = api_host(ctx)
    if _ip(host).is_unspecified and ctx.server.get("allowAllZeroIpListening") is not True:
        raise KeyRefused(f"{host} listens on every address, which MindIE allows only with allowAllZeroIpListening "
                         "true, and so does Sluice")
    source = f" (MIES_CONTAINER_IP, over {given!r})" if host != given else ""
    return effect(f"the gateways listen on {host}{source}", host=host)


def _management_ip(value: Any, ctx: Context) -> Outcome:
    address = ctx.environ.get("MIES_CONTAINER_MANAGEMENT_IP") or string(value)
    if address != api_host(ctx):
        raise KeyRefused(f"{address} is not ipAddress ({api_host(ctx)}): Sluice serves /health, /ready and /metrics "
                         "on the API's listener and has no management listener of its own; set it to "
                         f"{api_host(ctx)}")
    return no_effect("the same address as ipAddress: the management interfaces are served on the API's listener, "
                     "as MindIE serves them with one address")


def _zero_listening(value: Any, ctx: Context) -> Outcome:
    allowed = boolean(value)
    return effect(f"ipAddress 0.0.0.0 (every address) is {'allowed' if allowed else 'refused'}")


def _port(value: Any, ctx: Context) -> Outcome:
    port = integer(value, 1024, 65535)
    return effect(f"the first gateway listens on port {port}", port=port)


def _same_port(what: str) -> Handler:
    def check(value: Any, ctx: Context) -> Outcome:
        port, api = integer(value, 1024, 65535), ctx.server.get("port")
        if port != api:
            raise KeyRefused(f"{port} is not port ({api}): Sluice serves {what} on the API's port and has no "
                             f"listener of its own for them; set it to {api}")
        return no_effect(f"the same port as the API: {what} are served there, as MindIE does with equal ports")
    return check


def _max_link_num(value: Any, ctx: Context) -> Outcome:
    links = integer(value, 1, 4096)
    cap = LINKS_PER_MAX_LINK_NUM * links
    return effect(f"each gateway serves {cap} connections at once (MindIE: {links} requests in progress and "
                  f"{2 * links} queued); the next connection's request gets 503", max_connections=cap)


# -- ServerConfig: requests -----------------------------------------------------------------------------------
def _full_text(value: Any, ctx: Context) -> Outcome:
    if boolean(value):
        raise KeyRefused("streams carry each event's new text only (OpenAI's format); streaming the whole text so "
                         "far is not implemented")
    return no_effect("streams carry each event's new text, as MindIE's with false")


def _openai_support(value: Any, ctx: Context) -> Outcome:
    return no_effect(f"{string(value)!r}: /v1/chat/completions is OpenAI's API and takes vLLM's extra fields (MindIE's "
                     "\"vllm\" interface); plain OpenAI clients are served as they are")


def _token_timeout(value: Any, ctx: Context) -> Outcome:
    integer(value, 1, 3600)
    return no_effect("Sluice has no deadline between two tokens: e2eTimeout (--request-timeout) bounds the whole "
                     "request")


def _e2e_timeout(value: Any, ctx: Context) -> Outcome:
    seconds = integer(value, 1, 65535)
    if ctx.top.get("EnableDynamicAdjustTimeoutConfig") is True:
        return no_effect("EnableDynamicAdjustTimeoutConfig lifts it: no gateway deadline")
    return effect(f"each request's gateway deadline: {seconds} s", request_timeout=float(seconds))


def _max_request_length(value: Any, ctx: Context) -> Outcome:
    mib = integer(value, 1, 100)
    return effect(f"request bodies of up to {mib} MiB; a larger one gets 413", max_body_bytes=mib * MIB)


def _infer_mode(value: Any, ctx: Context) -> Outcome:
    mode = string(value)
    if mode == "dmi":
        raise KeyRefused("\"dmi\": prefill-decode disaggregation is not implemented (Sluice's instances run both)")
    if mode != "standard":
        raise KeyRefused(f"{mode!r} is not a MindIE mode (standard, dmi)")
    return no_effect("prefill and decode on the same instance: Sluice's only mode")


def _switch_off(what: str, refusal: str) -> Handler:
    """A switch that Sluice honours only off."""
    def check(value: Any, ctx: Context) -> Outcome:
        if boolean(value):
            raise KeyRefused(refusal)
        return no_effect(f"{what} off, as Sluice always runs")
    return check


_PD_ONLY = no_effect("only used between prefill-decode disaggregated instances (inferMode dmi), which Sluice does "
                     "not run")
_LAYERWISE_ONLY = no_effect("only used with layerwiseDisaggregated true, which Sluice does not run")

SERVER_KEYS: dict[str, Handler] = {
    "ipAddress": _ip_address,
    "managementIpAddress": _management_ip,
    "port": _port,
    "managementPort": _same_port("the management interfaces (/health, /ready)"),
    "metricsPort": _same_port("the metrics (/metrics)"),
    "allowAllZeroIpListening": _zero_listening,
    "maxLinkNum": _max_link_num,
    "fullTextEnabled": _full_text,
    "openAiSupport": _openai_support,
    "tokenTimeout": _token_timeout,
    "e2eTimeout": _e2e_timeout,
    "maxRequestLength": _max_request_length,
    "inferMode": _infer_mode,
    "distDPServerEnabled": _switch_off("the distributed DP server", "the distributed DP server of large-scale "
                                       "expert parallel is not implemented: run replicas with modelInstanceNumber"),
    "layerwiseDisaggregated": _switch_off("layer-wise disaggregation", "layer-wise disaggregation is not "
                                          "implemented"),
    **{key: constant(_PD_ONLY) for key in (
        "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath", "interCommTlsCaFiles", "interCommTlsCaFile",
        "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrlPath", "interCommTlsCrlFiles",
        "interCommTlsCrl", "pdInterNodeTLSEnabled", "pdCommunicationPort")},
    **{key: constant(_LAYERWISE_ONLY) for key in (
        "layerwiseDisaggregatedRoleType", "layerwiseDisaggregatedMasterIpAddress",
        "layerwiseDisaggregatedSlaveIpAddress", "layerwiseDisaggregatedDataPort", "layerwiseDisaggregatedCrtlPort")},
}
