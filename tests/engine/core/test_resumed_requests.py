"""A request resumed from another engine (``resumed_output_tokens``, request migration) continues exactly: the
prompt plus the first K tokens an undisturbed run produced, with K resumed, yields that run's remaining tokens and
finish reason — greedy, seeded sampling with penalties, min_tokens and bad words, and a seeded grammar after a
thinking budget — and reports the original prompt's length. What it may not continue is refused, naming the field.
EngineCore on a tiny random Qwen3 checkpoint with a word-level vocabulary (tests/reasoning_checkpoint.py)."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.sampling_params import BeamSearch, ReasoningParams, SamplingParams, StructuredOutputsParams
from engine.text import Tokenizer
from engine.worker.sampler import Sampler
from engine.worker.structured_output import GrammarVocabulary
from tests.reasoning_checkpoint import ANSWER_SCHEMA, EOS, ID, VOCAB, write_thinking_checkpoint

END = ID["</think>"]
PROMPT = [ID["<|user|>"], ID["hi"], ID["Ġok"], ID["<|assistant|>"], ID["<think>"]]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineCore]:
    path = write_thinking_checkpoint(tmp_path_factory.mktemp("resumed"))
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                                   disable_log_stats=True), show_progress=False,
                      grammar_vocabulary=GrammarVocabulary.from_tokenizer(Tokenizer.from_pretrained(str(path))))
    yield core
    core.close()


def run(core: EngineCore, prompt: list[int], params: SamplingParams, resumed: int = 0
        ) -> tuple[list[int], FinishReason | None, int]:
    """(tokens the engine sent, finish reason, prompt tokens it reported) of one request run alone."""
    core.add_request("r", prompt, params, resumed_output_tokens=resumed)
    tokens: list[int] = []
    reason: FinishReason | None = None
    num_prompt = -1
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
            num_prompt = out.num_prompt_tokens
    blocks = core.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks   # idle: every block came back
    return tokens, reason, num_prompt


def check_continuations(core: EngineCore, params: SamplingParams, cuts: list[int] | None = None) -> list[int]:
    """Resume the undisturbed run after each of ``cuts`` tokens (None: every cut) and check it ends the same."""
    full, reason, num_prompt = run(core, PROMPT, params)
    assert num_prompt == len(PROMPT) and len(full) > 2
    for k in cuts if cuts is not None else range(1, len(full)):
        rest, rest_reason, rest_prompt = run(core, PROMPT + full[:k], params, resumed=k)
        assert (rest, rest_reason) == (full[k:], reason), f"resumed after {k} tokens"
        assert rest_prompt == len(PROMPT)   # usage: the client's prompt, not prompt + resumed output
    return full


def test_greedy_resumed_request_continues_as_the_undisturbed_one(core: EngineCore) -> None:
    check_continuations(core, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), [1, 5, 11])


def test_seeded_sampling_with_penalties_continues_draw_for_draw(core: EngineCore,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, min_tokens=20, presence_penalty=0.5,
                            frequency_penalty=0.7, repetition_penalty=1.3, bad_words_token_ids=[[ID["hi"]]])
    full = check_continuations(core, params, [1, 2, 7, 13, 19, 23])
    assert len(set(full)) > 6 and ID["hi"] not in full   # sampled and banned: a wrong draw or ban would show
    # A generator that did not skip the resumed tokens' draws samples another continuation.
    monkeypatch.setattr(Sampler, "skip_draws", lambda self, generator, num_steps: None)
    assert run(core, PROMPT + full[:7], params, resumed=7)[0] != full[7:]


def test_seeded_grammar_after_a_thinking_budget_continues(core: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=ANSWER_SCHEMA),
                            reasoning=ReasoningParams(END, thinking_token_budget=4))
    full = check_continuations(core, params)   # every cut: in the thinking, at its end, inside the JSON
    assert full.index(END) == 4
    answer = "".join(VOCAB[t] for t in full[5:] if t != EOS)
    jsonschema.validate(json.loads(answer), ANSWER_SCHEMA)


@pytest.mark.parametrize(("resumed", "params", "message"), [
    (len(PROMPT) + 1, SamplingParams(max_tokens=8), "at most the prompt's length"),
    (2, SamplingParams(n=2, max_tokens=8), "n = 1"),
    (2, SamplingParams(n=1, best_of=2, max_tokens=8), "best_of"),
    (2, SamplingParams(max_tokens=8, beam_search=BeamSearch(beam_width=2)), "beam search"),
    (3, SamplingParams(max_tokens=3), "max_tokens"),
])
def test_what_cannot_be_resumed_is_refused_naming_the_field(core: EngineCore, resumed: int, params: SamplingParams,
                                                            message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as e:
        core.add_request("bad", PROMPT, params, resumed_output_tokens=resumed)
    assert e.value.field == "resumed_output_tokens"
    assert not core.has_unfinished_requests()
