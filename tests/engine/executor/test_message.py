"""The driver → worker message: a schema any MessagePack reader can decode without our types, and no pickle
anywhere in the engine."""
from __future__ import annotations

import ast
import base64
import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.executor.message import SCHEMA, decode, encode_init_cache, encode_shutdown, encode_step
from engine.worker.step_inputs import StepInputs

ENGINE = Path(__file__).resolve().parents[3] / "engine"


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[StepInputs]:
    """The inputs of a real engine's first two steps: prefill chunks (one asking prompt logprobs) then decodes."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, block_size=4,
                                   max_num_batched_tokens=16))
    runner = core.executor.worker.runner   # type: ignore[attr-defined]
    assert runner is not None
    published: list[StepInputs] = []
    runner.publish = lambda inputs: published.append(copy.deepcopy(inputs))   # its arrays view reused buffers
    core.add_request("a", list(range(1, 11)), SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2))
    core.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    return published


def _plain(data: bytes) -> dict[str, Any]:
    """The message as a MessagePack reader that knows nothing of ours sees it."""
    plain = msgspec.msgpack.decode(data)
    assert isinstance(plain, dict)
    return plain


def _json_form(plain: object) -> object:
    """The same message in its JSON form (byte strings as base64), which SCHEMA describes."""
    if isinstance(plain, bytes):
        return base64.b64encode(plain).decode()
    if isinstance(plain, dict):
        return {k: _json_form(v) for k, v in plain.items()}
    if isinstance(plain, list):
        return [_json_form(v) for v in plain]
    return plain


def _i64(b: object) -> list[int]:
    assert isinstance(b, bytes)
    return np.frombuffer(b, dtype="<i8").tolist()


def test_a_step_decodes_to_plain_maps_that_match_its_inputs(steps: list[StepInputs]) -> None:
    first = steps[0]   # a's prompt (its logprobs asked) and b's, whole: both sample
    assert first.num_tokens == 13
    plain = _plain(encode_step(first))
    assert plain["kind"] == "execute"
    assert _i64(plain["input_ids"]) == first.input_ids.tolist() == list(range(1, 11)) + [5, 6, 7]
    assert _i64(plain["positions"]) == list(range(10)) + [0, 1, 2]
    assert _i64(plain["slot_mapping"]) == first.slot_mapping.tolist()
    assert plain["block_size"] == 4 and plain["block_copies"] == []
    # The compute_logits calls in order: a's prompt positions that predict a prompt token, then the sampled rows.
    assert [_i64(r) for r in plain["logits_rows"]] == [list(range(9)), [9, 12]]
    (mb,) = plain["micro_batches"]
    assert (mb["token_start"], mb["token_end"], mb["query_lens"], mb["seq_lens"], mb["num_decodes"]) == \
        (0, 13, [10, 3], [10, 3], 0)
    tables = np.asarray(_i64(mb["block_tables"]), dtype=np.int64).reshape(mb["num_seqs"], mb["max_blocks"])
    np.testing.assert_array_equal(tables, first.micro_batches[0].block_tables)
    decoded = decode(encode_step(first))
    assert isinstance(decoded, StepInputs)
    np.testing.assert_array_equal(decoded.slot_mapping, first.slot_mapping)
    assert [r.tolist() for r in decoded.logits_rows] == [r.tolist() for r in first.logits_rows]


def test_every_message_kind_validates_against_the_schema(steps: list[StepInputs]) -> None:
    messages = [encode_init_cache(32), *(encode_step(s) for s in steps), encode_shutdown()]
    kinds = [_plain(m)["kind"] for m in messages]
    assert kinds[0] == "init_cache" and kinds[-1] == "shutdown" and set(kinds[1:-1]) == {"execute"}
    for data in messages:
        jsonschema.validate(_json_form(_plain(data)), SCHEMA)
    broken = _json_form(_plain(encode_step(steps[0])))
    assert isinstance(broken, dict)
    del broken["slot_mapping"]
    with pytest.raises(jsonschema.ValidationError, match="slot_mapping"):
        jsonschema.validate(broken, SCHEMA)
    assert json.dumps(SCHEMA)   # a JSON document, for readers in any language


_PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "copyreg", "shelve", "marshal", "joblib",
             "multiprocessing"}   # multiprocessing pickles what it sends


def _pickle_uses(source: str) -> list[str]:
    """Imports of a pickling module, references to one by name, torch.load, and allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in _PICKLERS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _PICKLERS:
            found.append(node.module)
        elif isinstance(node, ast.Name) and node.id in _PICKLERS:
            found.append(node.id)
        elif isinstance(node, ast.Constant) and node.value in _PICKLERS:   # importlib.import_module("pickle")
            found.append(repr(node.value))
        elif isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            found.append("torch.load")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            found.append("allow_pickle")
    return found


def test_nothing_in_the_engine_pickles() -> None:
    assert _pickle_uses("import pickle\nfrom multiprocessing import Pool\nw = torch.load(f)\n"
                        "np.load(f, allow_pickle=True)\nimportlib.import_module('dill')") == \
        ["pickle", "multiprocessing", "torch.load", "allow_pickle", "'dill'"]
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 50
    uses = {str(f.relative_to(ENGINE)): u for f in files if (u := _pickle_uses(f.read_text(encoding="utf-8")))}
    # vLLM's block hash (--prefix-caching-hash-algo sha256, its default, which routers reproduce) hashes the
    # pickled bytes of a block's key: that module may serialise with pickle, and only that — never deserialise.
    hashing = uses.pop("core/block_hashing.py", [])
    assert uses == {}
    assert set(hashing) <= {"pickle"}
    attrs = {node.attr for node in ast.walk(ast.parse((ENGINE / "core" / "block_hashing.py").read_text()))
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pickle"}
    assert attrs <= {"dumps", "HIGHEST_PROTOCOL"}, attrs
