"""A KV offload tier behind a real engine (a tiny random Llama on the CPU): a prompt whose blocks the device pool
evicted comes back with its blocks loaded from the tier, and answers as transformers does with no cache at all."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from common.errors import InvalidRequestError
from engine.config import EngineConfig, KVOffloadConfig
from engine.core.engine_core import EngineCore
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.args import add_engine_args, config_from_args
from engine.worker.kv_transfer import DiskTier
from services.child_flags import engine_flags
from tests.engine.core.tiny_llama import save_tiny_llama

BLOCK = 4
PROMPT_LEN = 41          # 10 full blocks a return can hit (one token is always computed)
MAX_TOKENS = 4
LOGPROBS: dict[str, list[float]] = {}
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4   # K and V, 2 layers, 4 tokens, 2 KV heads of 16, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny-offload")
    return path, save_tiny_llama(path)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(PROMPT_LEN)] for _ in range(n)]


def reference(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, computed from scratch."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request run alone (its tokens' logprobs in ``LOGPROBS``)."""
    core.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                        logprobs=0))
    tokens: list[int] = []
    LOGPROBS[request_id] = []
    cached = -1
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in core.step():
            tokens += out.new_token_ids
            LOGPROBS[request_id] += [entry[0] for entry in out.new_logprobs or []]
            cached = out.num_cached_tokens
    return tokens, cached


def make_core(checkpoint: Path, offload: KVOffloadConfig | None) -> EngineCore:
    # 16 device blocks: two other prompts of 11-12 blocks evict every block of the first.
    return EngineCore(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=16, block_size=BLOCK,
                                   async_scheduling=False, kv_offloading_config=offload), show_progress=False)


@pytest.fixture(params=["native", "disk"])
def offload(request: pytest.FixtureRequest, tmp_path: Path) -> KVOffloadConfig:
    backend: str = request.param
    slots = 64
    per_block = BLOCK_BYTES + (512 if backend == "disk" else 0)
    return KVOffloadConfig(size_gib=slots * per_block / 2**30, backend=backend,
                           path=str(tmp_path / "tier") if backend == "disk" else None)


@pytest.fixture
def core(tiny: tuple[Path, LlamaForCausalLM], offload: KVOffloadConfig) -> Iterator[EngineCore]:
    engine = make_core(tiny[0], offload)
    try:
        yield engine
    finally:
        engine.close()


def tier_files(core: EngineCore) -> list[Path]:
    offload = core.config.kv_offloading_config
    assert offload is not None and offload.path is not None
    return sorted((Path(offload.path) / "sluice-kv-dp0-rank0").glob("*.kv"))


def wait_for_writes(core: EngineCore) -> None:
    """The disk tier writes on its I/O thread: wait until every block the index holds has its file."""
    connector = core.scheduler.kv_offload
    assert connector is not None
    deadline = time.monotonic() + 10
    while len(tier_files(core)) < len(connector.index):
        assert time.monotonic() < deadline, "the tier's files were not written"
        time.sleep(0.01)


def test_a_returning_prompt_is_served_from_the_tier_with_the_reference_output(
        core: EngineCore, tiny: tuple[Path, LlamaForCausalLM]) -> None:
    a, b, c = prompts(1, 3)
    expected = reference(tiny[1], a)
    first, cached = run(core, "a", a)
    assert (first, cached) == (expected, 0)
    run(core, "b", b)
    run(core, "c", c)
    bm = core.scheduler.block_manager
    connector = core.scheduler.kv_offload
    assert connector is not None
    assert connector.num_stored >= 10
    again, cached = run(core, "a2", a)
    assert again == expected
    assert LOGPROBS["a2"] == pytest.approx(LOGPROBS["a"], abs=1e-5)   # the very KV the first run computed
    assert cached >= 0.9 * PROMPT_LEN and cached == 10 * BLOCK
    stats = core.scheduler_stats()
    assert stats["external_prefix_cache_hits"] == 10 * BLOCK
    assert stats["external_prefix_cache_queries"] == 4 * PROMPT_LEN   # every prompt was looked up in the tier
    assert stats["prefix_cache_hits"] == 10 * BLOCK   # the loaded blocks are an ordinary hit at admission
    bm.check_invariants([])


def test_a_corrupted_disk_entry_is_recomputed_not_served(tiny: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    offload = KVOffloadConfig(size_gib=64 * (BLOCK_BYTES + 512) / 2**30, backend="disk", path=str(tmp_path))
    core = make_core(tiny[0], offload)
    try:
        a, b, c = prompts(2, 3)
        expected = reference(tiny[1], a)
        assert run(core, "a1", a)[0] == expected
        run(core, "b", b)
        run(core, "c", c)
        wait_for_writes(core)
        connector = core.scheduler.kv_offload
        assert connector is not None
        probe = Request("probe", a, SamplingParams(max_tokens=1))
        assert core.scheduler.block_manager.get_computed_blocks(probe) == []   # (and it hashes the prompt)
        hashes = probe.block_hashes
        slot = connector.index.slot_of(hashes[4])
        assert slot is not None
        entry = Path(tmp_path) / "sluice-kv-dp0-rank0" / f"{slot:08d}.kv"
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF   # one flipped byte in the middle of the payload
        entry.write_bytes(bytes(data))
        again, cached = run(core, "a2", a)
        assert again == expected
        assert LOGPROBS["a2"] == pytest.approx(LOGPROBS["a1"], abs=1e-5)
        assert cached == 4 * BLOCK   # the blocks before the corrupted one; it and those after are recomputed
        assert hashes[4] not in connector.index and not entry.exists()
        assert core.scheduler_stats()["external_prefix_cache_hits"] == 4 * BLOCK
    finally:
        core.close()


def test_a_request_aborted_while_its_blocks_load_leaves_nothing_behind(
        core: EngineCore, tiny: tuple[Path, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    read = DiskTier._read

    def slow_read(self: DiskTier, slot: int, block_hash: bytes) -> torch.Tensor | None:
        time.sleep(0.05)   # a slow disk: the reads are still running when the abort comes
        return read(self, slot, block_hash)

    monkeypatch.setattr(DiskTier, "_read", slow_read)
    a, b, c = prompts(5, 3)
    run(core, "a", a)
    run(core, "b", b)
    run(core, "c", c)
    connector = core.scheduler.kv_offload
    assert connector is not None
    # Another request decodes meanwhile, so the steps do not wait for the disk tier's reads.
    core.add_request("d", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    core.step()
    core.add_request("a2", a, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    core.step()   # its load starts
    offload = core.config.kv_offloading_config
    assert offload is not None
    # A host tier's load lands in the step that starts it; a disk tier's in a later one.
    assert connector.num_loading == (1 if offload.backend == "disk" else 0)
    if connector.num_loading:
        assert core.scheduler.num_waiting == 1
        core.abort_requests(["a2"])
        assert connector.num_loading == 0
    while core.has_unfinished_requests():
        core.step()
    core.scheduler.block_manager.check_invariants([])
    again, cached = run(core, "a3", a)
    assert again == reference(tiny[1], a) and cached == 10 * BLOCK


def test_the_tier_never_holds_more_than_its_budget(tiny: tuple[Path, LlamaForCausalLM], offload: KVOffloadConfig
                                                   ) -> None:
    small = KVOffloadConfig(size_gib=offload.size_gib * 12 / 64, backend=offload.backend, path=offload.path)
    core = make_core(tiny[0], small)
    try:
        connector = core.scheduler.kv_offload
        assert connector is not None and connector.index.num_slots == 12
        worker = core.executor.worker.runner.kv_transfer  # type: ignore[attr-defined]
        assert worker.num_slots == 12   # the worker sizes the same tier from its cache tensors
        for i, prompt in enumerate(prompts(3, 6)):
            run(core, f"r{i}", prompt)
            assert len(connector.index) <= 12
        assert connector.num_stored > 12   # it did evict
        if small.backend == "disk":
            wait_for_writes(core)
            assert sum(f.stat().st_size for f in tier_files(core)) <= small.size_bytes
            assert len(tier_files(core)) <= 12
        else:
            assert worker.host.pool.nbytes <= small.size_bytes
    finally:
        core.close()


@pytest.mark.parametrize("changes, flag", [
    ({"enable_prefix_caching": False}, "kv_offloading_size"),
    ({"async_scheduling": True}, "async_scheduling"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, "tensor_parallel_size"),
])
def test_combinations_it_cannot_honour_are_refused_by_name(changes: dict[str, object], flag: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(kv_offloading_config=KVOffloadConfig(size_gib=1.0), **changes)  # type: ignore[arg-type]
    assert e.value.field == flag


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flags_make_the_config_and_sluice_serve_passes_them_on(tmp_path: Path) -> None:
    config = parse(["--kv-offloading-size", "0.5", "--kv-offloading-backend", "disk",
                    "--kv-offloading-path", str(tmp_path)])
    assert config.kv_offloading_config == KVOffloadConfig(size_gib=0.5, backend="disk", path=str(tmp_path))
    assert parse(engine_flags(config)) == config
    assert parse(["--kv-offloading-size", "2"]).kv_offloading_config == KVOffloadConfig(2.0, "native")
    assert parse([]).kv_offloading_config is None


@pytest.mark.parametrize("argv, flag", [
    (["--kv-offloading-size", "1", "--kv-offloading-backend", "disk"], "--kv-offloading-path"),
    (["--kv-offloading-size", "1", "--kv-offloading-path", "/tmp"], "--kv-offloading-path"),
    (["--kv-offloading-backend", "disk", "--kv-offloading-path", "/tmp"], "--kv-offloading-backend"),
    (["--kv-offloading-size", "0"], "--kv-offloading-size"),
    (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "kv_offloading_size"),
])
def test_a_bad_flag_combination_is_refused_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse(argv)
    assert e.value.field == flag
