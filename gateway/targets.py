"""Where the gateway's gRPC channels go: one target for every tokenizer service, and the options."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # 128k-token prompts as ids and their logprobs fit easily


def grpc_target(addresses: Sequence[str]) -> str:
    """One channel target for all tokenizer services.

    A full target (``dns:///name:port``, ``ipv4:…``, ``unix:…``) is used as is;
    one ``host:port`` becomes ``dns:///host:port`` (re-resolved, so every A
    record is balanced over); several become a static ``ipv4:``/``ipv6:`` list,
    host names resolved once here.
    """
    addrs = [a.strip() for a in addresses if a.strip()]
    if not addrs:
        raise ValueError("no tokenizer address given")
    if len(addrs) == 1:
        addr = addrs[0]
        return addr if ":/" in addr or addr.split(":", 1)[0] in ("ipv4", "ipv6", "unix", "dns") else f"dns:///{addr}"
    resolved = [_resolve(a) for a in addrs]
    families = {ip.version for ip, _ in resolved}
    if len(families) != 1:
        raise ValueError("tokenizer addresses mix IPv4 and IPv6")
    if families == {4}:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in resolved)
    return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in resolved)


def _resolve(addr: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, sep, port_s = addr.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ValueError(f"tokenizer address {addr!r} is not host:port")
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host), int(port_s)
    except ValueError:
        infos = socket.getaddrinfo(host, int(port_s), type=socket.SOCK_STREAM)
        ips = [ipaddress.ip_address(i[4][0]) for i in infos]
        ips.sort(key=lambda ip: ip.version)  # prefer IPv4, the common case for "localhost"
        return ips[0], int(port_s)


def tls_authority(addresses: Sequence[str]) -> str | None:
    """The name a TLS channel to several listed addresses checks the servers' certificates against: the
    one host they share (``127.0.0.1`` under ``sluice serve``). gRPC would check the whole ``ipv4:`` list,
    which no certificate names; one channel has one name, so addresses on different hosts are refused.
    None for one address or a full target: gRPC checks the host dialed."""
    addrs = [a.strip() for a in addresses if a.strip()]
    if len(addrs) < 2:
        return None
    hosts = {a.rpartition(":")[0].strip("[]") for a in addrs}
    if len(hosts) != 1:
        raise ValueError("with gRPC TLS, listed tokenizer addresses must share one host name (the one their "
                         "certificates name); give one dns:/// name for services on several hosts")
    return hosts.pop()


# Round robin over the healthy services only: gRPC's client-side health checking (gRFC A17) watches each
# service's standard health status for the whole server (""), and a service reporting NOT_SERVING (its engine is
# down, or it drains) leaves the rotation until it serves again; its channel reads TRANSIENT_FAILURE meanwhile. A
# service without the health service counts as healthy.
_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})


def channel_options(authority: str | None = None) -> list[tuple[str, object]]:
    """``authority``: the name TLS checks the servers' certificates against (:func:`tls_authority`)."""
    return [
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        *([("grpc.default_authority", authority)] if authority is not None else []),
    ]
