"""The default model (SmolLM2-135M-Instruct, its GGUF dequantized at load) under ``--quantization w8a8`` against the
same model in bfloat16 (issue 29's acceptance): greedy agreement on 20 fixed prompts and perplexity on a fixed text.

Agreement is measured with teacher forcing, the definition that does not punish a single early divergence for every
token after it: bfloat16 generates greedily (the offline API), then both models read each prompt with bfloat16's
answer, and a position agrees when W8A8's argmax is bfloat16's token. Both runs are scored by the same forward
pass, so bfloat16's own score is checked too (it must reproduce its own answers)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import default_model_path
from engine.core.sampling_params import SamplingParams
from engine.device import CpuDevice
from engine.entrypoints.llm import LLM
from engine.models import CausalLM, load_model
from tests.engine.kernel_probe import prepare
from tests.engine.paged_factory import PagedKV

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colors are",
    "A good breakfast usually includes", "To make a cup of tea, you first", "The largest planet in our solar system",
    "In the morning, the birds", "The main ingredient of bread is", "My favourite season is autumn because",
    "A bicycle has two wheels and", "The quickest way to learn a language is", "Photosynthesis is the process by",
    "When it rains, people usually", "The dog ran across the field and", "An apple a day",
    "The history of the Roman Empire", "Computers store information as", "The ocean is home to many",
    "She opened the door and saw", "Here is a short poem about the moon:",
]
ANSWER_TOKENS = 24

TEXT = (
    "Every town has a market day. In ours it is Saturday, when the square fills with stalls before the sun is up. "
    "The baker arrives first, with bread still warm from the oven, and the smell drifts down the narrow streets. "
    "Farmers bring potatoes, onions, apples and eggs from the villages nearby, and a woman from the hills sells "
    "honey in small glass jars. People come early to find the best vegetables, and they stay to talk with their "
    "neighbours. Children run between the stalls while their parents count coins and compare prices. By noon the "
    "square is crowded and noisy, and the cafe on the corner has no empty tables. In the afternoon the traders pack "
    "their vans, sweep the ground, and drive home along the river road. The square is quiet again, and the pigeons "
    "return to look for crumbs. Next week the market will come back, as it has done for more than a hundred years, "
    "and the town will wake up early once more to meet it."
)

AGREEMENT_MIN = 0.80      # the bar
PERPLEXITY_REL_MAX = 0.03


def _forward(model: CausalLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits of every position of each sequence, all read in one step."""
    cfg = model.config
    kv = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=16, dtype=torch.bfloat16,
                 backend=CpuDevice().attention_backend())
    step = kv.step([(str(i), s) for i, s in enumerate(sequences)])
    with torch.no_grad():
        logits = model.compute_logits(model(step.input_ids, step.positions, kv.kv_caches, step.meta))
    return list(logits.split([len(s) for s in sequences]))


def _perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(tokens[1:]))
    return math.exp(float(nll))


@pytest.fixture(scope="module")
def references() -> tuple[list[list[int]], list[int], list[int]]:
    """bfloat16's greedy answers (prompt ids, answer ids per prompt) and the text's ids."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=32)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS + [TEXT], params)
    finally:
        llm.close()
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs[:-1]]
    prompt_lens = [len(o.prompt_token_ids) for o in outs[:-1]]
    return sequences, prompt_lens, outs[-1].prompt_token_ids


def test_w8a8_agrees_with_bfloat16_and_keeps_its_perplexity(
        references: tuple[list[list[int]], list[int], list[int]]) -> None:
    sequences, prompt_lens, text = references
    path = default_model_path()
    bf16 = prepare(load_model(path, torch.bfloat16), torch.bfloat16)
    w8a8 = load_model(path, torch.bfloat16, quantization="w8a8")
    assert w8a8.int8_linears == 30 * 4 + 1 and w8a8.quantized_linears == 0   # the projections and the lm_head
    prepare(w8a8, torch.bfloat16)

    def agreement(model: CausalLM) -> float:
        matches = total = 0
        for logits, seq, n in zip(_forward(model, sequences), sequences, prompt_lens, strict=True):
            predicted = logits[n - 1:-1].argmax(-1)
            matches += int((predicted == torch.tensor(seq[n:])).sum())
            total += len(seq) - n
        return matches / total

    own = agreement(bf16)
    assert own >= 0.95   # bfloat16 reproduces its own greedy answers (batched reads may round differently)
    agreed = agreement(w8a8)
    ppl_bf16 = _perplexity(_forward(bf16, [text])[0], text)
    ppl_w8a8 = _perplexity(_forward(w8a8, [text])[0], text)
    print(f"W8A8 vs bfloat16: agreement {agreed:.3f} (bfloat16 itself {own:.3f}), perplexity {ppl_w8a8:.3f} vs "
          f"{ppl_bf16:.3f} ({100 * (ppl_w8a8 / ppl_bf16 - 1):+.2f} %), {len(text)} tokens")
    assert agreed >= AGREEMENT_MIN
    assert abs(ppl_w8a8 / ppl_bf16 - 1) <= PERPLEXITY_REL_MAX
