"""Multi-step decode (``num_scheduler_steps`` N > 1) is exact: greedy and seeded outputs are token for token those
of N = 1 (penalties, min_tokens, n > 1, prefills joining, preemption), stop tokens, stop strings, ``max_tokens``
and ``max_model_len`` hold exactly, every KV block comes back, and the outputs of a step's passes are streamed
one pass at a time or delivered together (``multi_step_stream_outputs``)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from common.errors import InvalidRequestError
from engine.config import EngineConfig, SpeculativeConfig
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request
from engine.core.sampling_params import BeamSearch, SamplingParams, StructuredOutputsParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.llm import LLM
from tests.lora_factory import save_tiny_model

Tokens = dict[tuple[str, int], list[int]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi_step")
    paths = {"llama": root / "llama", "qwen2": root / "qwen2"}
    save_tiny_model(paths["llama"], "llama", 1)
    save_tiny_model(paths["qwen2"], "qwen2", 3)
    # A word-level tokenizer over the tiny vocabulary, for the offline LLM's stop strings.
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(paths["llama"] / "tokenizer.json"))
    return paths


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 128, size=int(rng.integers(4, 30)))] for _ in range(count)]


def make_core(model: Path, steps: int, **config: object) -> EngineCore:
    cfg = EngineConfig(model=str(model), num_scheduler_steps=steps, disable_log_stats=True,
                       **{"dtype": "float32", "num_kv_blocks": 256, **config})  # type: ignore[arg-type]
    return EngineCore(cfg, show_progress=False)


def run(core: EngineCore, batch: list[list[int]], params: SamplingParams, *, late: int = 0
        ) -> tuple[Tokens, dict[str, FinishReason], int]:
    """Run ``batch`` to the end; the last ``late`` prompts arrive after two steps (their prefills run with the
    others' multi-step decodes). Returns (tokens per sequence, finish reasons, the most lookahead passes any
    step gave a row). Checks the block manager after every step and that every block came back."""
    tokens: Tokens = {}
    reasons: dict[str, FinishReason] = {}
    most = 0
    schedule = core.scheduler.schedule

    def spy() -> SchedulerOutput:
        nonlocal most
        out = schedule()
        most = max([most] + [s.num_lookahead_steps for s in out.scheduled])
        return out

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    for i, prompt in enumerate(batch[:len(batch) - late]):
        core.add_request(str(i), prompt, params)
    steps = 0
    while core.has_unfinished_requests() or steps < 2:
        if steps == 2:
            for i in range(len(batch) - late, len(batch)):
                core.add_request(str(i), batch[i], params)
        for out in core.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[f"{out.request_id}/{out.index}"] = out.finish_reason
        core.scheduler.block_manager.check_invariants([r for r in core.scheduler.requests.values() if r.block_ids])
        steps += 1
    assert core.scheduler.block_manager.num_free_blocks == core.num_blocks   # every block came back
    return tokens, reasons, most


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# The tiny Qwen2 (tied embeddings) greedily repeats its last token: a penalty makes its outputs tell positions apart.
PENALIZED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=2.0)
# Penalties and min_tokens read the earlier passes' tokens; a stop token can end a row mid-step; n = 2 forks.
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, seed=7, n=2, repetition_penalty=1.3,
                        frequency_penalty=0.4, min_tokens=6, stop_token_ids=[5, 9, 17, 40, 77])
# best_of ranks its sequences by the cumulative logprob of every pass's token.
BEST_OF = SamplingParams(max_tokens=16, temperature=0.8, seed=3, n=2, best_of=3, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("params", [GREEDY, PENALIZED, SEEDED, BEST_OF], ids=["greedy", "penalized", "seeded",
                                                                            "best_of"])
def test_outputs_are_those_of_single_step(checkpoints: dict[str, Path], arch: str, params: SamplingParams) -> None:
    batch = prompts(12)
    want, want_reasons, _ = run(make_core(checkpoints[arch], 1), batch, params, late=4)
    got, got_reasons, most = run(make_core(checkpoints[arch], 8), batch, params, late=4)
    assert most == 7   # rows really ran 7 further passes
    assert got == want
    assert got_reasons == want_reasons
    if params is SEEDED:   # some rows stopped on a stop token, some ran to max_tokens
        assert {FinishReason.STOP, FinishReason.LENGTH} <= set(want_reasons.values())
    lengths = [len(t) for (rid, i), t in got.items() if want_reasons[f"{rid}/{i}"] is FinishReason.LENGTH]
    assert lengths and set(lengths) == {params.max_tokens}


def test_preemption_keeps_the_outputs(checkpoints: dict[str, Path]) -> None:
    batch = prompts(8, seed=1)
    want, _, _ = run(make_core(checkpoints["llama"], 1), batch, GREEDY)
    core = make_core(checkpoints["llama"], 8, num_kv_blocks=14)   # 224 tokens for ~8 x 40: some are preempted
    got, _, most = run(core, batch, GREEDY)
    assert core.scheduler.num_preemptions > 0 and most == 7
    assert got == want


def test_max_model_len_is_never_overrun(checkpoints: dict[str, Path]) -> None:
    max_len = 40
    prompt = prompts(1, seed=2)[0][:1] * (max_len - 3)   # ends 3 tokens before max_model_len
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    want, want_reasons, _ = run(make_core(checkpoints["llama"], 1, max_model_len=max_len), [prompt], params)
    core = make_core(checkpoints["llama"], 8, max_model_len=max_len)
    runner = core.executor.worker.runner  # type: ignore[attr-defined]
    written: list[int] = []
    run_pass = runner._run

    def spy(inputs, *rest):  # type: ignore[no-untyped-def]
        written.extend(inputs.positions.tolist())
        return run_pass(inputs, *rest)

    runner._run = spy
    got, reasons, most = run(core, [prompt], params)
    assert got == want and len(got[("0", 0)]) == 3
    assert reasons == want_reasons == {"0/0": FinishReason.LENGTH}
    assert most == 1   # the decode step after the prefill: one further pass, not 7
    # The last token is sampled, never computed: the highest position written is max_model_len - 2.
    assert max(written) == max_len - 2 and written.count(max_len - 2) == 1


def lookahead_of(sched: Scheduler, request: Request) -> int:
    """The lookahead passes the next step gives ``request``, after a prefill step that sampled its first token."""
    sched.add_request(request)
    first = sched.schedule()
    sched.update_from_output(first, {seq_id: [7] for s in first.scheduled for seq_id in s.sample_seq_ids})
    out = sched.schedule()
    rows = [s for s in out.scheduled if s.request is request]
    assert len(rows) == 1 and rows[0].is_decode
    assert out.num_batched_tokens == 1   # lookahead passes take none of the step's token budget
    return rows[0].num_lookahead_steps


@pytest.mark.parametrize(("params", "max_model_len", "want"), [
    ({}, 4096, 7),
    ({"max_tokens": 5}, 4096, 3),          # outputs 1 + 1 + 3 = max_tokens exactly
    ({"max_tokens": 2}, 4096, 0),
    ({}, 14, 2),                           # 11 tokens after the prefill: 1 + 2 more tokens reach 14
    ({"structured_outputs": StructuredOutputsParams(regex="[ab]+")}, 4096, 0),
])
def test_eligibility(params: dict[str, object], max_model_len: int, want: int) -> None:
    sched = Scheduler(EngineConfig(num_scheduler_steps=8), 64, eos_token_ids={2}, max_model_len=max_model_len)
    request = Request("r", list(range(3, 13)), SamplingParams(**{"ignore_eos": True, **params}))  # type: ignore[arg-type]
    assert lookahead_of(sched, request) == want


def test_forks_and_beams_are_not_eligible_in_their_first_steps() -> None:
    sched = Scheduler(EngineConfig(num_scheduler_steps=8), 64, eos_token_ids={2}, max_model_len=4096)
    sched.add_request(Request("n", list(range(3, 13)), SamplingParams(n=3, ignore_eos=True)))
    prefill = sched.schedule()
    assert [s.num_lookahead_steps for s in prefill.scheduled] == [0]   # a prefill samples the fork's n tokens
    sched.update_from_output(prefill, {seq_id: [7] for s in prefill.scheduled for seq_id in s.sample_seq_ids})
    assert [s.num_lookahead_steps for s in sched.schedule().scheduled] == [7, 7, 7]   # forked: each alone
    beams = Scheduler(EngineConfig(num_scheduler_steps=8), 64, eos_token_ids={2}, max_model_len=4096)
    request = Request("b", list(range(3, 13)), SamplingParams(beam_search=BeamSearch(2), max_tokens=8))
    beams.add_request(request)
    assert all(s.num_lookahead_steps == 0 for s in beams.schedule().scheduled)


def test_refused_with_speculative_decoding() -> None:
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(num_scheduler_steps=4, speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)).validate()
    assert e.value.field == "num_scheduler_steps" and "speculative" in str(e.value)


def test_stop_strings_and_max_tokens_are_those_of_single_step(checkpoints: dict[str, Path]) -> None:
    batch = [[int(t) for t in p] for p in prompts(6, seed=3)]
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with LLM(str(checkpoints["llama"]), dtype="float32", num_kv_blocks=64) as one:
        texts = [o.outputs[0].text for o in one.generate([{"prompt_token_ids": p} for p in batch], plain)]
        # A stop string from the middle of each text: it ends generation somewhere inside a multi-step step.
        stops = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[t[len(t) // 2:][:3]])
                 for t in texts]
        want = one.generate([{"prompt_token_ids": p} for p in batch], stops)
        capped = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
        want_capped = one.generate([{"prompt_token_ids": p} for p in batch], capped)
    with LLM(str(checkpoints["llama"]), dtype="float32", num_kv_blocks=64, num_scheduler_steps=8) as eight:
        got = eight.generate([{"prompt_token_ids": p} for p in batch], stops)
        got_capped = eight.generate([{"prompt_token_ids": p} for p in batch], capped)
        assert eight.engine.scheduler.block_manager.num_free_blocks == eight.engine.num_blocks
    assert [o.outputs[0].finish_reason for o in want] == ["stop"] * len(batch)
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in got] == \
        [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in want]
    assert [o.outputs[0].token_ids for o in got_capped] == [o.outputs[0].token_ids for o in want_capped]
    assert all(len(o.outputs[0].token_ids) == 11 and o.outputs[0].finish_reason == "length" for o in got_capped)


# ----- delivery: one pass at a time, or the step's tokens together -------------------------------------------

def deliveries(checkpoints: dict[str, Path], stream: bool, delay_s: float = 0.0
               ) -> list[tuple[float, list[EngineCoreOutput]]]:
    """A request for 9 tokens, two of them (n = 2) after its prefill: one prefill step, then one step of 8
    passes. Returns each hand-over (to the sink, or the step's return) with its time; each pass sleeps
    ``delay_s`` first."""
    core = make_core(checkpoints["llama"], 8, multi_step_stream_outputs=stream)
    got: list[tuple[float, list[EngineCoreOutput]]] = []
    core.output_sink = lambda outs: got.append((time.perf_counter(), outs))
    execute = core.executor.execute_model

    def slow(out: SchedulerOutput):  # type: ignore[no-untyped-def]
        time.sleep(delay_s)
        return execute(out)

    core.executor.execute_model = slow  # type: ignore[method-assign,assignment]
    core.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, n=2))
    outs = core.step()   # the prefill: 1 token each
    got.append((time.perf_counter(), outs))
    while core.has_unfinished_requests():
        start = time.perf_counter()
        outs = core.step()
        got.append((time.perf_counter(), outs))
        got.insert(1, (start, []))   # marks when the multi-step step began
    return got


def test_streaming_delivers_each_pass_as_it_ends(checkpoints: dict[str, Path]) -> None:
    got = deliveries(checkpoints, True, delay_s=0.05)
    began = got[1][0]
    passes = got[2:]
    assert len(passes) == 8   # 7 to the sink as each pass ended, the last one returned by step()
    for _, outs in passes:
        assert sorted((o.index, len(o.new_token_ids)) for o in outs) == [(0, 1), (1, 1)]
    times = [t for t, _ in passes]
    # Pass k's tokens come after k + 1 slowed passes, before the later ones have run.
    for k, t in enumerate(times):
        assert t - began >= 0.05 * (k + 1)
    assert all(b - a >= 0.04 for a, b in zip(times, times[1:]))
    assert [o.request_finished for o in passes[-1][1]] == [False, True]


def test_without_streaming_the_step_tokens_come_together(checkpoints: dict[str, Path]) -> None:
    got = deliveries(checkpoints, False)
    streamed = deliveries(checkpoints, True)
    assert len(got) == 3   # the prefill step, the start mark, one hand-over of the multi-step step
    outs = got[2][1]
    assert [(o.index, len(o.new_token_ids), o.finish_reason) for o in outs] == \
        [(0, 8, FinishReason.LENGTH), (1, 8, FinishReason.LENGTH)]
    assert [o.request_finished for o in outs] == [False, True]   # the request's end comes last
    for o in outs:
        assert o.new_token_ids == [t for _, p in streamed[2:] for s in p if s.index == o.index
                                   for t in s.new_token_ids]


def test_async_engine_streams_one_token_per_pass(checkpoints: dict[str, Path]) -> None:
    async def collect(stream: bool) -> list[list[int]]:
        engine = await AsyncEngine.launch(lambda: make_core(checkpoints["llama"], 8, multi_step_stream_outputs=stream))
        try:
            params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
            return [out.new_token_ids async for out in engine.generate("r", [5, 6, 7, 8], params)]
        finally:
            engine.shutdown()

    streamed = asyncio.run(collect(True))
    together = asyncio.run(collect(False))
    assert [len(t) for t in streamed] == [1] * 9
    assert [len(t) for t in together] == [1, 8]
    assert sum(streamed, []) == sum(together, [])
