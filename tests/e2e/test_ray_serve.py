"""`sluice serve --distributed-executor-backend ray --tensor-parallel-size 2` on a Ray cluster of two hosts
(tests/ray_cluster.py): the engine joins the cluster ``RAY_ADDRESS`` names, its second rank runs on the other host,
the official openai SDK's request is answered token for token as transformers answers it, and no rank outlives
``sluice serve``."""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.lora_factory import save_tiny_model
from tests.procs import ServeStack
from tests.ray_cluster import TwoNodeRayCluster, net_namespace, netns_available, pid_alive

pytestmark = pytest.mark.slow

PROMPT_IDS = [1, 5, 9, 33, 70, 12]
MAX_TOKENS = 8
SERVED = "tiny-tp2"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A tiny random Llama with a word-level tokenizer ("w5" is id 5), and its greedy continuation of
    PROMPT_IDS by transformers."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_model(path, "llama")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return path, ids[0, len(PROMPT_IDS):].tolist()


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodeRayCluster]:
    if not netns_available():
        pytest.skip("the two-host Ray cluster needs root and `ip netns`")
    c = TwoNodeRayCluster()
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, cluster: TwoNodeRayCluster,
          checkpoint: tuple[Path, list[int]]) -> Iterator[ServeStack]:
    with pytest.MonkeyPatch.context() as env:   # what `sluice serve` inherits: RAY_ADDRESS, gloo's interface
        for name, value in cluster.driver_env().items():
            env.setenv(name, value)
        s = ServeStack(tmp_path_factory.mktemp("ray-serve"), "--model", str(checkpoint[0]), "--served-model-name",
                       SERVED, "--dtype", "float32", "--distributed-executor-backend", "ray",
                       "--tensor-parallel-size", "2", "--num-threads", "1", "--num-kv-blocks", "64",
                       "--max-num-seqs", "4")
        try:
            s.start()
        except BaseException:
            s.stop()
            raise
    try:
        yield s
    finally:
        s.stop()


def _rank_pids(log: Path) -> list[int]:
    """The pids of ranks 0 and 1 from the engine's start-up line (ray_executor)."""
    m = re.search(r"ray executor: 2 ranks .*rank 0 on .* pid (\d+), rank 1 on .* pid (\d+)", log.read_text())
    assert m is not None, "no ray executor start-up line in the log"
    return [int(m.group(1)), int(m.group(2))]


def test_openai_sdk_request_is_answered_by_ranks_on_two_hosts(
        stack: ServeStack, cluster: TwoNodeRayCluster, checkpoint: tuple[Path, list[int]]) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=SERVED, prompt=" ".join(f"w{i}" for i in PROMPT_IDS),
                                    max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    expected = Tokenizer.from_file(str(checkpoint[0] / "tokenizer.json")).decode(checkpoint[1])
    assert out.choices[0].text == expected
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == \
        (len(PROMPT_IDS), MAX_TOKENS)

    driver, rank1 = _rank_pids(stack.log)
    assert net_namespace(driver) != net_namespace(rank1) == cluster.netns_b()
    assert stack.stop() == 0
    deadline = time.monotonic() + 10
    while pid_alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank1), "rank 1's actor outlived sluice serve"
