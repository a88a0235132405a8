"""Sliding-window attention against transformers on tiny random checkpoints whose window is shorter than the prompt:
Mistral (every layer), Qwen2 with ``use_sliding_window`` from ``max_window_layers`` on (local and global layers
interleaved), and a config that lists ``layer_types``. Logits within 1e-4 (float32) over a prefill and decode steps
past the window, in a mixed step of decodes and chunked prefill, and on a prefix-cache hit; on the PyTorch path and
the CPU kernels' (whose fast paths hand windowed steps to the windowed gather)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from engine import LLM, InvalidRequestError, SamplingParams
from engine.models import CausalLM, load_model
from engine.models.config import config_from_hf
from engine.models.decoder_layer import Attention
from tests.engine.kernel_probe import prepare, uses_cpu_ops
from tests.engine.models.moe_factory import randomize, write_tokenizer
from tests.engine.models.paged_run import (
    assert_prefill_then_greedy_decode,
    greedy_continuation,
    hf_logits,
    paged,
    prompt,
    run,
)

TOL = 1e-4
WINDOW = 6
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)

VARIANTS: dict[str, Callable[[], PreTrainedModel]] = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=WINDOW)),
    # layers 1 and 2 local, layer 0 global
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1)),
    # transformers' own per-layer list: local, global, local
    "layer_types": lambda: Qwen2ForCausalLM(Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
WINDOWED = {"mistral": [0, 1, 2], "qwen2": [1, 2], "layer_types": [0, 2]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    out = {}
    for kind, make in VARIANTS.items():
        torch.manual_seed(0)
        hf = make().eval()
        randomize(hf, 1)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path)
        write_tokenizer(path)
        out[kind] = (hf, path)
    return out


@pytest.fixture(scope="module", params=[(v, p) for v in VARIANTS for p in ("torch", "cpu-kernels")],
                ids=lambda vp: "+".join(vp))
def pair(request: pytest.FixtureRequest, checkpoints: dict[str, tuple[PreTrainedModel, Path]]
         ) -> tuple[str, PreTrainedModel, CausalLM]:
    kind, path = request.param
    hf, ckpt = checkpoints[kind]
    ours = load_model(str(ckpt), torch.float32)
    if path == "cpu-kernels":
        prepare(ours, torch.float32)
        assert uses_cpu_ops(ours)
    return kind, hf, ours


def test_the_windows_are_read_per_layer(pair: tuple[str, PreTrainedModel, CausalLM]) -> None:
    kind, _, ours = pair
    windows = [layer.self_attn.window for layer in ours.layers]
    assert [i for i, w in enumerate(windows) if w is not None] == WINDOWED[kind]
    assert {w for w in windows if w is not None} == {WINDOW}


def test_prefill_and_decode_past_the_window_match_transformers(pair: tuple[str, PreTrainedModel, CausalLM]) -> None:
    _, hf, ours = pair
    # longer than the window: the full-attention answer would differ
    assert_prefill_then_greedy_decode(hf, ours, prompt(15, 2), 12)


def test_mixed_steps_chunks_and_prefix_hits_match_transformers(pair: tuple[str, PreTrainedModel, CausalLM]) -> None:
    _, hf, ours = pair
    a, b, c = prompt(11, 3), prompt(4, 4), prompt(17, 5)
    kv = paged(ours)
    run(ours, kv, [("a", a[:10]), ("b", b[:3]), ("c", c[:9])])
    logits = run(ours, kv, [("a", a[10:]), ("b", b[3:]), ("c", c[9:])])   # two decodes, a chunk after 9 tokens
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf, b)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[2:], hf_logits(hf, c)[9:], atol=TOL, rtol=0)
    d = c[:12] + prompt(6, 6)   # a prefix hit on c's first three blocks
    kv.tables["d"], kv.tokens["d"] = kv.tables["c"][:3], list(d[:12])
    torch.testing.assert_close(run(ours, kv, [("d", d[12:])]), hf_logits(hf, d)[12:], atol=TOL, rtol=0)


def test_the_engine_gives_transformers_greedy_tokens_and_disable_caps_the_context(
        checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    hf, path = checkpoints["qwen2"]
    start = prompt(9, 7)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": start}, sp)[0].outputs[0].token_ids == greedy_continuation(hf, start, 12)
    # vLLM's --disable-sliding-window: full attention, the context capped at the window
    capped = LLM(str(path), dtype="float32", num_kv_blocks=16, disable_sliding_window=True)
    assert capped.engine.max_model_len == WINDOW
    assert all(m.window is None for m in capped.engine.executor.worker.model.modules() if isinstance(m, Attention))
    with pytest.raises(InvalidRequestError, match="max_model_len.*sliding window 6"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, disable_sliding_window=True, max_model_len=64)


def test_a_window_the_qwen2_config_does_not_switch_on_is_not_read() -> None:
    cfg = {"model_type": "qwen2", **_COMMON, "sliding_window": WINDOW, "use_sliding_window": False}
    assert config_from_hf(cfg, None, True).sliding_window is None
    on = config_from_hf({**cfg, "use_sliding_window": True, "max_window_layers": 3}, None, True)
    assert on.sliding_window is None   # no layer from max_window_layers on: no window anywhere
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({"model_type": "qwen2", **_COMMON, "sliding_window": WINDOW, "use_sliding_window": True,
                        "layer_types": ["chunked_attention"] * 3}, None, True)
    # Mistral's layer_types are ignored by transformers: every layer keeps the window
    mistral = config_from_hf({"model_type": "mistral", **_COMMON, "sliding_window": WINDOW,
                              "layer_types": ["full_attention"] * 3}, None, True)
    assert [mistral.window_of(i) for i in range(3)] == [WINDOW] * 3


def test_blocks_outside_every_window_are_given_back_with_the_same_outputs(
        checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    """Mistral (every layer slides, window 6, blocks of 4): a long generation holds at most the window plus one block
    (and the one being written) per sequence, counted from the block manager, and still gives transformers' tokens;
    Qwen2 here interleaves a global layer, so it keeps every block."""
    from engine.core.block_manager import RELEASED
    from engine.core.engine_core import EngineCore
    from engine.core.request import SequenceId

    hf, path = checkpoints["mistral"]
    starts = [prompt(5, 40), prompt(9, 41)]
    expected = [greedy_continuation(hf, start, 30) for start in starts]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=32, seed=0)
    core: EngineCore = llm.engine
    assert core.scheduler.reclaim_window == WINDOW
    for i, start in enumerate(starts):
        core.add_request(f"r{i}", start, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    held, released, tokens = 0, 0, {0: [], 1: []}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[int(out.request_id[1:])] += out.new_token_ids
        for i in range(2):
            request = core.scheduler.requests.get(SequenceId(f"r{i}"))
            if request is not None and request.block_ids:
                held = max(held, sum(1 for b in request.block_ids if b != RELEASED))
                released = max(released, request.block_ids.count(RELEASED))
    assert [tokens[0], tokens[1]] == expected
    # window 6 in blocks of 4: 2 blocks for the window, 1 it straddles, 1 being written; never the ~10 of the context
    assert released > 0 and held <= -(-WINDOW // 4) + 2, (held, released)
    info = core.info()
    assert info["free_kv_blocks"] == info["total_kv_blocks"]
    assert LLM(str(checkpoints["qwen2"][1]), dtype="float32", num_kv_blocks=16).engine.scheduler.reclaim_window is None
