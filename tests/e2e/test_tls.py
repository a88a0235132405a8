"""Issue 26's TLS acceptance: `sluice serve` with HTTPS on REST and mutual TLS on every gRPC hop, certificates
made here with openssl. The official openai SDK trusting our CA gets answers (through gateway -> tokenizer ->
engine, each hop over mTLS); plain HTTP and untrusted HTTPS get none; a grpcio client without a client
certificate is refused by the tokenizer's and the engine's ports, and with one it generates."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.procs import ServeStack
from tests.tls_factory import CertFiles, make_ca, make_cert

pytestmark = pytest.mark.slow

SERVED = "tls-model"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    return {"ca": ca, "server": make_cert(d, ca, "server"), "client": make_cert(d, ca, "client")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, CertFiles]) -> Iterator[ServeStack]:
    ca, server = pki["ca"], pki["server"]
    s = ServeStack(tmp_path_factory.mktemp("tls"), "--served-model-name", SERVED, "--max-num-seqs", "2",
                   "--ssl-certfile", str(server.cert), "--ssl-keyfile", str(server.key),
                   "--grpc-tls-cert", str(server.cert), "--grpc-tls-key", str(server.key),
                   "--grpc-tls-ca", str(ca.cert),
                   ssl_context=ssl.create_default_context(cafile=str(ca.cert))).start()
    yield s
    assert s.stop() == 0


def _tokenizer_addr(stack: ServeStack) -> str:
    return f"127.0.0.1:{stack.tokenizer_port}"


def _credentials(pki: dict[str, CertFiles], with_client_cert: bool) -> grpc.ChannelCredentials:
    ca = pki["ca"].cert.read_bytes()
    if not with_client_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=pki["client"].key.read_bytes(),
                                        certificate_chain=pki["client"].cert.read_bytes())


def _generate(channel: grpc.Channel) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
    request = generation_pb2.GenerateRequest(text="The capital of France is",
                                             sampling=common_pb2.SamplingParameters(temperature=0.0),
                                             stopping=generation_pb2.StoppingCriteria(max_tokens=8,
                                                                                      ignore_eos=True))
    return list(stub.Generate(request, timeout=60))


def test_openai_sdk_trusting_the_ca_gets_answers(stack: ServeStack, pki: dict[str, CertFiles]) -> None:
    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki["ca"].cert))) as http:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=http)
        assert stack.base_url.startswith("https://")
        r = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 8 and r.choices[0].text
        chunks = list(client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_plain_http_and_untrusted_https_get_no_answer(stack: ServeStack) -> None:
    with pytest.raises(httpx.TransportError):  # the TLS listener hangs up on a plaintext request
        httpx.get(f"http://127.0.0.1:{stack.port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # the system's roots: not ours
        httpx.get(f"https://127.0.0.1:{stack.port}/health", timeout=10)


def test_grpc_without_a_client_certificate_is_refused(stack: ServeStack, pki: dict[str, CertFiles]) -> None:
    for addr in (_tokenizer_addr(stack), stack.engine_addr):
        with grpc.secure_channel(addr, _credentials(pki, with_client_cert=False)) as channel:
            with pytest.raises(grpc.RpcError) as e:
                _generate(channel) if addr != stack.engine_addr else \
                    engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE, addr
        with grpc.insecure_channel(addr) as channel:  # plaintext: no handshake at all
            with pytest.raises(grpc.RpcError) as e:
                _generate(channel)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE, addr


def test_grpc_with_a_client_certificate_generates(stack: ServeStack, pki: dict[str, CertFiles]) -> None:
    with grpc.secure_channel(_tokenizer_addr(stack), _credentials(pki, with_client_cert=True)) as channel:
        messages = _generate(channel)
    assert sum(len(m.token_ids) for m in messages) == 8
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert "".join(m.text for m in messages)


def test_bad_file_stops_serve_naming_flag_and_file(tmp_path: Path, pki: dict[str, CertFiles]) -> None:
    """Before any child starts: one line, no traceback."""
    import subprocess
    import sys

    from tests.procs import ROOT

    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--ssl-certfile", str(pki["server"].cert),
                          "--ssl-keyfile", str(pki["client"].key)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"sluice serve: --ssl-keyfile {pki['client'].key} does not match the certificate "
                                  f"in --ssl-certfile {pki['server'].cert}")


# -- issue 39: a MindIE config.json with httpsEnabled true -------------------------------------------------------
MINDIE_SERVED = "mindie-tls"


def _mindie_install(root: Path, pki: dict[str, CertFiles], **server: object) -> Path:
    """A MindIE install folder: conf/config.json (HTTPS, the TLS files where MindIE's defaults put them, one
    listener, the default model on the CPU) and security/ holding ``pki``'s CA and server certificate."""
    import json
    import shutil

    for src, dst in ((pki["ca"].cert, "security/ca/ca.pem"), (pki["server"].cert, "security/certs/server.pem"),
                     (pki["server"].key, "security/keys/server.key.pem")):
        (root / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / dst)
    config = {
        "Version": "1.0.0",
        "ServerConfig": {
            "ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": 1025, "managementPort": 1025,
            "metricsPort": 1025, "allowAllZeroIpListening": False, "maxLinkNum": 4, "httpsEnabled": True,
            "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"], "tlsCert": "security/certs/server.pem",
            "tlsPk": "security/keys/server.key.pem", "tlsPkPwd": "security/pass/key_pwd.txt",
            "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"], "e2eTimeout": 120, **server},
        "BackendConfig": {
            "backendName": "mindieservice_llm_engine", "modelInstanceNumber": 1, "tokenizerProcessNumber": 1,
            "ModelDeployConfig": {"maxSeqLen": 2048, "maxInputTokenLen": 2047, "truncation": False, "ModelConfig": [
                {"modelInstanceType": "Standard", "modelName": MINDIE_SERVED, "worldSize": 1, "cpuMemSize": 0,
                 "npuMemSize": -1, "backendType": "atb", "trustRemoteCode": False}]},
            "ScheduleConfig": {"templateType": "Standard", "templateName": "Standard_LLM", "cacheBlockSize": 16,
                               "maxPrefillBatchSize": 2, "maxPrefillTokens": 2048, "maxBatchSize": 2,
                               "maxIterTimes": 2048, "prefillPolicyType": 0, "decodePolicyType": 0}},
    }
    (root / "conf").mkdir(parents=True, exist_ok=True)
    (root / "conf/config.json").write_text(json.dumps(config, indent=4))
    return root / "conf/config.json"


def _client_context(pki: dict[str, CertFiles]) -> ssl.SSLContext:
    """Trusts the CA and presents the client certificate it signed (MindIE's HTTPS requires one)."""
    context = ssl.create_default_context(cafile=str(pki["ca"].cert))
    context.load_cert_chain(pki["client"].cert, pki["client"].key)
    return context


@pytest.fixture(scope="module")
def mindie_stack(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, CertFiles]) -> Iterator[ServeStack]:
    config = _mindie_install(tmp_path_factory.mktemp("mindie"), pki)
    s = ServeStack(tmp_path_factory.mktemp("mindie-logs"), "--config", str(config),
                   ssl_context=_client_context(pki)).start()
    yield s
    assert s.stop() == 0


def test_mindie_https_serves_the_openai_sdk_trusting_the_ca(mindie_stack: ServeStack,
                                                           pki: dict[str, CertFiles]) -> None:
    with httpx.Client(verify=_client_context(pki)) as http:
        client = openai.OpenAI(base_url=f"{mindie_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=http)
        assert mindie_stack.base_url.startswith("https://")
        r = client.completions.create(model=MINDIE_SERVED, prompt="The capital of France is", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 8 and r.choices[0].text
    log = mindie_stack.log.read_text()
    assert "MindIE ServerConfig.maxLinkNum: each gateway serves 12 connections at once" in log
    assert "MindIE ServerConfig.tlsCrlFiles: no effect (" in log


def test_mindie_https_refuses_plain_http_and_clients_without_a_certificate(mindie_stack: ServeStack,
                                                                           pki: dict[str, CertFiles]) -> None:
    with pytest.raises(httpx.TransportError):  # the TLS listener hangs up on plaintext
        httpx.get(f"http://127.0.0.1:{mindie_stack.port}/health", timeout=10)
    with pytest.raises(httpx.TransportError):  # trusts the CA but has no client certificate: the handshake fails
        httpx.get(f"https://127.0.0.1:{mindie_stack.port}/health", timeout=10,
                  verify=ssl.create_default_context(cafile=str(pki["ca"].cert)))


def test_mindie_https_without_its_certificate_file_stops_start_up_naming_the_key(
        tmp_path: Path, pki: dict[str, CertFiles]) -> None:
    """Before any child starts: exit 2, the last line naming the key and the file; never plain HTTP."""
    import subprocess
    import sys

    from tests.procs import ROOT

    config = _mindie_install(tmp_path, pki)
    (tmp_path / "security/certs/server.pem").unlink()
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--config", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"sluice serve: error: ServerConfig.tlsCert: {tmp_path / 'security/certs/server.pem'}: cannot read it "
        "(No such file or directory)")
