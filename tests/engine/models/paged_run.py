"""What the model tests against transformers share: a step of our model through a paged KV cache, transformers'
logits for the same ids, a reproducible prompt, and the attention backend matching a model's kernel choice."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.device import CpuDevice
from engine.models import CausalLM
from tests.engine.kernel_probe import uses_cpu_ops
from tests.engine.paged_factory import PagedKV


def backend_for(model: CausalLM) -> AttentionBackend:
    """The CPU device's backend (its kernels) for a model prepared on them, else PyTorch's."""
    return CpuDevice().attention_backend() if uses_cpu_ops(model) else TorchAttentionBackend()


def paged(model: CausalLM, block_size: int = 4, dtype: torch.dtype = torch.float32) -> PagedKV:
    """A garbage-filled paged cache shaped for ``model`` (one plane for a latent cache)."""
    kv = PagedKV(model.num_local_layers, model.num_local_kv_heads, model.kv_head_dim, block_size=block_size,
                 dtype=dtype, backend=backend_for(model))
    kv.kv_caches = [c[:model.kv_planes].contiguous() for c in kv.kv_caches]
    return kv


def run(model: CausalLM, kv: PagedKV, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
    """One step over ``chunks`` (sequence id, new ids); the logits of every new token."""
    step = kv.step(chunks)
    with torch.no_grad():
        hidden = model(step.input_ids, step.positions, kv.kv_caches, step.meta)
        assert isinstance(hidden, torch.Tensor)
        return model.compute_logits(hidden)


def hf_logits(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_prefill_then_greedy_decode(hf: PreTrainedModel, model: CausalLM, tokens: list[int], steps: int,
                                      atol: float = 1e-4) -> list[int]:
    """``tokens`` prefilled in one step, then ``steps`` greedy decode steps through ``model``'s paged cache, every
    step's logits within ``atol`` of transformers' for the same ids. Returns the whole sequence."""
    tokens = list(tokens)
    kv = paged(model)
    logits = run(model, kv, [("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=atol, rtol=0)
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = run(model, kv, [("a", tokens[-1:])])
        torch.testing.assert_close(logits[0], hf_logits(hf, tokens)[-1], atol=atol, rtol=0)
    return tokens


def greedy_continuation(hf: PreTrainedModel, start: list[int], steps: int) -> list[int]:
    """transformers' own greedy continuation of ``start`` (``steps`` ids, no eos stop)."""
    ids = list(start)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(start):]
