"""What each rank runs in the model-parallel tests (``harness.run_ranks``), and the unsharded reference runs the same
code in one process.

A rank loads its shard of its stage, then runs a prefill of a few prompts and greedy decode steps through its own
paged KV cache, as the model runner will: every rank builds the same step (the same block tables), a stage
receives the hidden states and residual of the stage before it and sends its own on, the last stage sends its
final hidden states back to stage 0, whose tensor ranks compute the logits together; rank 0 picks the next tokens
and broadcasts them (``ParallelContext.broadcast_bytes``). No transformers import here: every rank would pay it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.device import CpuDevice
from engine.distributed import ParallelContext
from engine.models import CausalLM, load_model
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.linear import Linear, linear_methods
from tests.engine.paged_factory import PagedKV, Step


@dataclass
class RankResult:
    """What one rank saw: its logits (stage 0), the tokens it decoded, and what it holds."""

    logits: np.ndarray | None          # float32 [prefill tokens + decode steps * prompts, vocab] on stage 0
    tokens: list[list[int]]            # each prompt's greedy continuation, as this rank received it
    layers: tuple[int, int]
    num_kv_heads: int
    holds: dict[str, bool]             # embed_tokens, lm_head, norm
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    methods: dict[str, int] = field(default_factory=dict)
    quantized_linears: int = 0
    blocks_match_dense: bool = True    # each layer's GGUF blocks dequantize to the dense shard it loaded
    experts: dict[str, tuple[int, int, int]] = field(default_factory=dict)   # MoE layer: (first id, count, I)
    expert_params: int = 0             # elements of the routed experts' weights this rank holds


def pipeline_step(model: CausalLM, parallel: ParallelContext, step: Step, kv: PagedKV) -> torch.Tensor | None:
    """One step's forward pass on this rank; the logits of every row on stage 0, None elsewhere."""
    rows, hidden_size = step.input_ids.shape[0], model.config.hidden_size
    intermediate = None
    if not parallel.is_first_stage:
        x, residual = parallel.recv([(rows, hidden_size)] * 2, torch.float32, torch.device("cpu"),
                                    parallel.pp_rank - 1)
        intermediate = (x, residual)
    out = model(step.input_ids, step.positions, kv.kv_caches, step.meta, intermediate)
    if not parallel.is_last_stage:
        assert isinstance(out, tuple)
        for work in parallel.send(list(out), parallel.pp_rank + 1):
            work.wait()
        hidden = None
    else:
        assert isinstance(out, torch.Tensor)
        hidden = out
    if parallel.pp_size > 1 and parallel.is_last_stage:
        assert hidden is not None
        for work in parallel.send([hidden], 0):
            work.wait()
    elif parallel.pp_size > 1 and parallel.is_first_stage:
        hidden = parallel.recv([(rows, hidden_size)], torch.float32, torch.device("cpu"), parallel.pp_size - 1)[0]
    if not parallel.is_first_stage:
        return None
    assert hidden is not None
    with torch.no_grad():
        return model.compute_logits(hidden)


def _broadcast_tokens(parallel: ParallelContext, tokens: list[int] | None) -> list[int]:
    if parallel.world_size == 1:
        assert tokens is not None
        return tokens
    data = parallel.broadcast_bytes(np.asarray(tokens, dtype=np.int64).tobytes() if parallel.is_driver else None)
    return np.frombuffer(data, dtype=np.int64).tolist()


def greedy(parallel: ParallelContext, path: str, prompts: list[list[int]], steps: int,
           kernels: bool = False, expert_parallel: bool = False) -> RankResult:
    """Loads this rank's shard of ``path`` (float32), prefills ``prompts`` in one step, then decodes ``steps`` greedy
    tokens for each. ``kernels``: the CPU device's kernel choice (oneDNN-packed shards, GGUF blocks, cpu_ops),
    else PyTorch's ops; ``expert_parallel``: mixture-of-experts layers split their experts over the tensor ranks."""
    torch.set_num_threads(1)
    parallel = replace(parallel, expert_parallel=expert_parallel)
    model = load_model(path, torch.float32, "cpu", parallel)
    result = RankResult(logits=None, tokens=[[] for _ in prompts], layers=(model.start_layer, model.end_layer),
                        num_kv_heads=model.num_local_kv_heads,
                        holds={"embed_tokens": model.embed_tokens is not None, "lm_head": model.lm_head is not None,
                               "norm": model.norm is not None})
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            result.linear_shapes[name] = (module.out_features, module.in_features)
            if module.quant is not None:
                result.blocks_match_dense &= torch.equal(module.quant.dequantize(), module.weight)
        if isinstance(module, FusedMoE):
            result.experts[name] = (module.expert_start, module.num_local_experts, module.intermediate_size)
            result.expert_params += module.w13.numel() + module.w2.numel()
    result.quantized_linears = model.quantized_linears
    backend: AttentionBackend = TorchAttentionBackend()
    if kernels:
        device = CpuDevice(num_threads=1)
        model.use_kernels(device.kernel_choice(torch.float32, model.amx_pack_bytes()))
        backend = device.attention_backend()
    result.methods = dict(linear_methods(model))
    kv = PagedKV(model.num_local_layers, model.num_local_kv_heads, model.kv_head_dim, num_blocks=48,
                 block_size=4, backend=backend)
    kv.kv_caches = [c[:model.kv_planes].contiguous() for c in kv.kv_caches]   # one plane: MLA's latent cache
    names = [str(i) for i in range(len(prompts))]
    chunks = list(zip(names, prompts, strict=True))
    rows: list[torch.Tensor] = []
    for _ in range(steps + 1):
        logits = pipeline_step(model, parallel, kv.step(chunks), kv)
        picked = None
        if logits is not None:
            rows.append(logits)
            ends = np.cumsum([len(new) for _, new in chunks]) - 1
            picked = [int(logits[end].argmax()) for end in ends]
        picked = _broadcast_tokens(parallel, picked)
        for tokens, token in zip(result.tokens, picked, strict=True):
            tokens.append(token)
        chunks = [(name, [token]) for name, token in zip(names, picked, strict=True)]
    if rows:
        result.logits = torch.cat(rows).numpy()
    return result


def reference(path: str, prompts: list[list[int]], steps: int, kernels: bool = False,
              expert_parallel: bool = False) -> RankResult:
    """The whole model in this process, through the same code."""
    threads = torch.get_num_threads()
    try:
        return greedy(ParallelContext(), path, prompts, steps, kernels)
    finally:
        torch.set_num_threads(threads)


def run_all(parallel: ParallelContext, runs: list[tuple[str, dict[str, Any]]]) -> dict[str, RankResult]:
    """Several ``greedy`` runs (name, keyword arguments) in one process group, one after the other."""
    return {name: greedy(parallel, **kwargs) for name, kwargs in runs}
