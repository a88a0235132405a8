"""End-to-end acceptance of the engine core through the offline API, on the default GGUF model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.core.engine_core import EngineCore
from engine.core.request import SequenceId

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # fp32 so "identical token ids" is a fair demand across batch shapes; chunked prefill forced by a small budget.
    return LLM(dtype="float32", max_num_batched_tokens=64, max_num_seqs=64, kv_cache_memory="512MiB", seed=0)


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "mountains", "a cat", "Python", "the moon", "bread", "rain", "music"]
    return [f"Request {i}: write one sentence about {topics[i % len(topics)]} and number {i * 7}."
            for i in range(n)]


def _run_to_end(engine: EngineCore, rid: str) -> tuple[list[int], int]:
    """Step the core until rid finishes; returns (output token ids, tokens the scheduler computed for it)."""
    tokens: list[int] = []
    computed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
        assert engine.last_step is not None
        computed += engine.last_step.num_scheduled_tokens.get(SequenceId(rid), 0)
    return tokens, computed


def test_default_model_chat_answers_paris() -> None:
    llm = LLM()  # the default model with default settings (dtype auto)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_batch_invariance_with_chunked_prefill(llm: LLM) -> None:
    prompts = _prompts(32)
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert together == alone
    assert all(len(t) == 8 for t in alone)


def test_prefix_caching_computes_only_new_tokens(llm: LLM) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(100, 40000) for _ in range(512)]
    first = prefix + [rng.randrange(100, 40000) for _ in range(20)]
    second = prefix + [rng.randrange(100, 40000) for _ in range(23)]
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    engine.add_request("warm", first, sp)
    _run_to_end(engine, "warm")
    req = engine.add_request("hit", second, sp)
    hit_tokens, computed = _run_to_end(engine, "hit")
    assert req.num_cached_tokens == 512
    # The new prompt tokens plus one decode per generated token after the first.
    assert computed == (len(second) - 512) + (6 - 1)

    cold = LLM(dtype="float32", enable_prefix_caching=False, kv_cache_memory="256MiB")
    assert cold.generate({"prompt_token_ids": second}, sp)[0].outputs[0].token_ids == hit_tokens


def test_preemption_keeps_outputs_identical(llm: LLM) -> None:
    prompts = _prompts(8)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    # ~8 prompts of ~20 tokens growing to ~44 need ~24 blocks of 16; give them 12.
    small = LLM(dtype="float32", num_kv_blocks=12, block_size=16, max_num_seqs=8)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, sp)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert small.engine.info()["free_kv_blocks"] == small.engine.info()["total_kv_blocks"]


def test_same_seed_same_text_alone_or_in_batch(llm: LLM) -> None:
    prompts = _prompts(16)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=12, ignore_eos=True)
              for i in range(16)]
    batch = llm.generate(prompts, seeded)
    for i in (0, 5, 15):
        alone = llm.generate(prompts[i], seeded[i])[0].outputs[0]
        assert alone.token_ids == batch[i].outputs[0].token_ids
        assert alone.text == batch[i].outputs[0].text
    # Different seeds do produce different samples (the check above is not vacuous).
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 8


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)


def test_bad_prompts_rejected_before_any_step(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    with pytest.raises(InvalidRequestError) as err:
        llm.generate({"prompt_token_ids": [1, 2, vocab]}, GREEDY)
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as err:
        llm.generate({"prompt_token_ids": [5] * (llm.engine.max_model_len + 1)}, GREEDY)
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        llm.generate({"prompt_token_ids": []}, GREEDY)
    assert err.value.field == "prompt"
    # A bad request in a batch queues none of it, and the engine keeps serving.
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [vocab + 3]}], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("Hello", GREEDY)[0].outputs[0].token_ids) == 8
    info = llm.engine.info()
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


def test_n_outputs_and_stop_strings(llm: LLM) -> None:
    out = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                                                          ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    full = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[5:9]
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                         stop=[stop]))[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    info = llm.engine.info()
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


def test_array_prompts_as_the_grpc_servicer_passes_them(llm: LLM) -> None:
    """The engine servicer hands the core numpy arrays (int32 from shared memory, uint32 from protobuf):
    same outputs as a list, same prefix-cache hits, same validation."""
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(40)]
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("as-list", prompt, sp)
    expected, _ = _run_to_end(engine, "as-list")
    for dtype in (np.int32, np.uint32, np.int64):
        req = engine.add_request(f"as-{dtype.__name__}", np.array(prompt, dtype=dtype), sp)
        assert req.all_token_ids.dtype == np.int32 and req.all_token_ids.tolist() == prompt
        tokens, computed = _run_to_end(engine, req.request_id)
        assert tokens == expected
        assert req.num_cached_tokens == 32 and computed == (40 - 32) + (8 - 1)  # two full blocks of 16 cached
    vocab = engine.vocab_size
    for bad, field in ((np.array([1, vocab], dtype=np.uint32), "prompt_token_ids"),
                       (np.array([3, -1], dtype=np.int64), "prompt_token_ids"),
                       (np.array([[1, 2]], dtype=np.int32), "prompt_token_ids"),
                       (np.array([1.0, 2.0]), "prompt_token_ids"),
                       (np.array([], dtype=np.int32), "prompt")):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", bad, sp)
        assert e.value.field == field
    assert not engine.has_unfinished_requests()


def test_request_token_buffer_grows_past_its_first_capacity() -> None:
    from engine.core.request import Request

    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    for t in range(100):
        req.append_output_token(t)
    assert req.all_token_ids.tolist() == [5, 6, 7, *range(100)]
    assert req.prompt_token_ids.tolist() == [5, 6, 7] and req.num_tokens == 103
    assert req.output_token_ids == list(range(100))


def test_generate_on_another_thread_than_the_loading_one_warns_once(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    # The fixture loaded the model on this (main) thread, which stays alive: a worker thread's steps would get a
    # second OpenMP pool. The user is told once, and the results are the same.
    import threading

    expected = llm.generate("Hello there", GREEDY)[0].outputs[0].token_ids
    assert not [r for r in caplog.records if "OpenMP" in r.getMessage()]  # same thread: quiet
    got: list[list[int]] = []

    def work() -> None:
        for _ in range(2):
            got.append(llm.generate("Hello there", GREEDY)[0].outputs[0].token_ids)

    with caplog.at_level("WARNING", logger="engine.entrypoints.llm"):
        t = threading.Thread(target=work, name="worker-x")
        t.start()
        t.join()
    warnings = [r.getMessage() for r in caplog.records if "OpenMP" in r.getMessage()]
    assert len(warnings) == 1 and "'worker-x'" in warnings[0] and "'MainThread'" in warnings[0]
    assert got == [expected, expected]
