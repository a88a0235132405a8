"""vLLM's ``cache_salt``: only requests with the same salt share cached prompt blocks.

The hashes are recomputed here as vLLM computes them (``hash_block_tokens`` over pickle + sha256, the salt an
extra key of the first block only, after the LoRA name: ``generate_block_hash_extra_keys``), not with the
engine's function; then the same on a real EngineCore, read from what each request reports as cached."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.block_hashing import make_block_hasher
from engine.core.block_manager import BlockManager
from engine.core.engine_core import EngineCore
from engine.core.kv_events import BlockStored
from engine.core.lora_request import LoRARequest
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.llm import _cache_salts
from tests.engine.core.tiny_llama import save_tiny_llama

SEED = {"PYTHONHASHSEED": "0"}
BS = 4
PROMPT = list(range(3, 20))   # 17 tokens: 4 full blocks, the last one hit-able


def vllm_hash(parent: bytes | None, tokens: list[int], extra: tuple[Any, ...] | None) -> bytes:
    """vLLM's ``hash_block_tokens`` with ``sha256``: NONE_HASH = sha256(pickle(PYTHONHASHSEED)) for the first."""
    def sha(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    return sha((parent or sha("0"), tuple(tokens), extra))


def vllm_chain(tokens: list[int], salt: str | None, lora_name: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BS):
        keys = ([lora_name] if lora_name else []) + ([salt] if i == 0 and salt else [])
        hashes.append(vllm_hash(hashes[-1] if hashes else None, tokens[i * BS:(i + 1) * BS],
                                tuple(keys) if keys else None))
    return hashes


def request(rid: str, salt: str | None, lora: LoRARequest | None = None) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=4), cache_salt=salt, lora_request=lora)


def prefill(bm: BlockManager, req: Request) -> int:
    """Allocate and compute ``req``'s prompt after its prefix hit; the number of tokens served from the cache."""
    computed = bm.get_computed_blocks(req)
    assert bm.allocate(req, req.num_tokens - len(computed) * BS, computed)
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req, req.num_tokens)
    return len(computed) * BS


def test_block_hashes_are_vllms_with_the_salt_on_the_first_block_only() -> None:
    bm = BlockManager(32, BS, hash_fn=make_block_hasher("sha256", SEED), enable_kv_cache_events=True)
    salted, plain = request("a", "tenant-1"), request("b", None)
    lora = LoRARequest("ad", 1, "/x")
    both = request("c", "tenant-1", lora)
    for r in (salted, plain, both):
        prefill(bm, r)
    assert salted.block_hashes == vllm_chain(PROMPT, "tenant-1")
    assert plain.block_hashes == vllm_chain(PROMPT, None)
    assert both.block_hashes == vllm_chain(PROMPT, "tenant-1", "ad")
    # The salt changes the first hash, and through the chain every later one.
    assert not set(salted.block_hashes) & set(plain.block_hashes)
    # KV events carry the salted chain: a subscriber sees two disjoint sets of blocks.
    stored = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 3
    ints = [set(e.block_hashes) for e in stored]
    assert ints[0] == {int.from_bytes(h, "big") & (2 ** 64 - 1) for h in vllm_chain(PROMPT, "tenant-1")}
    assert not ints[0] & ints[1] and not ints[0] & ints[2] and not ints[1] & ints[2]


def test_only_the_same_salt_shares_cached_blocks() -> None:
    bm = BlockManager(64, BS, hash_fn=make_block_hasher("sha256", SEED))
    assert prefill(bm, request("a1", "a")) == 0
    assert prefill(bm, request("b1", "b")) == 0      # another salt: nothing shared
    assert prefill(bm, request("n1", None)) == 0     # unsalted: nothing shared with salted ones
    assert prefill(bm, request("a2", "a")) == 16     # same salt: the whole prompt but its last token
    assert prefill(bm, request("n2", None)) == 16
    assert prefill(bm, request("b2", "b")) == 16


def test_llm_reads_vllms_prompt_dict_key() -> None:
    assert _cache_salts([{"prompt": "a", "cache_salt": "x"}, "b", {"prompt_token_ids": [1]}]) == ["x", None, None]
    assert _cache_salts({"prompt": "a", "cache_salt": "y"}) == ["y"]
    assert _cache_salts(["a", "b"]) == [] and _cache_salts("a") == [] and _cache_salts([1, 2, 3]) == []


# ---------------------------------------------------------------- a real core


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    path: Path = tmp_path_factory.mktemp("tiny-salt")
    save_tiny_llama(path)
    return EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=BS, num_kv_blocks=64))


def run(core: EngineCore, rid: str, salt: str | None) -> tuple[int, list[int]]:
    """(prompt tokens the request was told were cached, its greedy tokens)."""
    core.add_request(rid, PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), cache_salt=salt)
    outputs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    mine = [o for o in outputs if o.request_id == rid]
    return mine[-1].num_cached_tokens, [t for o in mine for t in o.new_token_ids]


def test_engine_core_reports_cached_tokens_by_salt(core: EngineCore) -> None:
    cached, first = run(core, "x1", "alice")
    assert cached == 0
    assert run(core, "y1", "bob")[0] == 0
    assert run(core, "u1", None)[0] == 0
    cached, again = run(core, "x2", "alice")
    assert cached == 16 and again == first   # the cached KV gives the same greedy tokens
    assert run(core, "u2", None)[0] == 16


def test_forked_sequences_keep_the_salt(core: EngineCore) -> None:
    """n > 1: the sequences forked from the first after its first sample hash their blocks with its salt."""
    core.add_request("n2", PROMPT, SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1), cache_salt="s")
    seqs: list[Request] = []
    while core.has_unfinished_requests():
        core.step()
        seqs += [r for r in core.scheduler.running if r.request_id == "n2" and r not in seqs]
    assert sorted(r.index for r in seqs) == [0, 1, 2] and {r.cache_salt for r in seqs} == {"s"}


def test_engine_core_refuses_an_empty_salt(core: EngineCore) -> None:
    with pytest.raises(InvalidRequestError) as e:
        core.add_request("e", PROMPT, SamplingParams(max_tokens=1), cache_salt="")
    assert e.value.field == "cache_salt"
