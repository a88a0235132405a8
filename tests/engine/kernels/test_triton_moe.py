"""The Triton fused-MoE kernels (``engine.kernels.triton_moe``) against ``moe_reference`` (float32, token by token).

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``: numpy on CPU tensors), which
checks their indexing, masking and arithmetic on tiny shapes; the ``gpu`` tests run them compiled on CUDA, at
model-like sizes and inside a CUDA graph. Skipped when triton is not installed.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from engine.models.layers.fused_moe import FusedMoE, GroupedMoEMethod, moe_reference
from engine.models.moe_config import Routing
from tests.engine.triton_interpreter import choose_interpreter

ON_GPU = torch.cuda.is_available()
# (atol, rtol) against the float32 reference over the inputs as rounded to the dtype: float32 products are IEEE,
# the half types round the gate/up product and the activation once each.
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 3e-2)}


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    """``engine.kernels.triton_moe``, the interpreter chosen first where there is no GPU."""
    choose_interpreter()
    pytest.importorskip("triton")
    return importlib.import_module("engine.kernels.triton_moe")


@dataclass
class Experts:
    x: torch.Tensor        # [T, H]
    w13: torch.Tensor      # [E, 2I, H], every global expert
    w2: torch.Tensor       # [E, H, I]
    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor      # [T, k] int64, global

    def to(self, device: str, dtype: torch.dtype) -> Experts:
        return Experts(self.x.to(device, dtype), self.w13.to(device, dtype), self.w2.to(device, dtype),
                       self.weights.to(device), self.ids.to(device))


def _experts(seed: int, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
             used: list[int] | None = None) -> Experts:
    """Random experts (outputs of order 1) and each token's ``top_k`` distinct experts among ``used`` (all)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(used if used is not None else list(range(num_experts)))
    rows = [pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)]
    return Experts(x=torch.randn(num_tokens, hidden, generator=gen),
                   w13=torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5,
                   w2=torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5,
                   weights=torch.rand(num_tokens, top_k, generator=gen),
                   ids=torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.int64))


def _check(kernels: ModuleType, e: Experts, dtype: torch.dtype, device: str = "cpu", expert_start: int = 0,
           num_local: int | None = None) -> torch.Tensor:
    """Runs ``fused_moe`` over experts ``expert_start`` .. (``num_local`` of them; all) and compares it with the
    reference over every expert, the weights of the ids held elsewhere zeroed. Returns its output (on the host)."""
    num_local = e.w13.shape[0] - expert_start if num_local is None else num_local
    d = e.to(device, dtype)
    local = slice(expert_start, expert_start + num_local)
    out = kernels.fused_moe(d.x, d.w13[local], d.w2[local], d.weights, d.ids, expert_start).cpu()
    assert out.dtype == dtype and out.shape == e.x.shape
    held = (e.ids >= expert_start) & (e.ids < expert_start + num_local)
    rounded = e.to("cpu", dtype)
    expected = moe_reference(rounded.x, rounded.w13, rounded.w2, e.weights * held, e.ids)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    return out


def test_align_pairs_sorts_by_expert_and_pads_each_to_the_block(kernels: ModuleType) -> None:
    ids = torch.tensor([[0, 2], [2, 3], [3, 0], [2, 2]])   # pairs 0..7; expert 1 has none
    pairs, blocks = kernels.align_pairs(ids, 4, 0, 4)
    pad = 8
    # 8 pairs + 4 experts x 3 rows of padding at most: 5 blocks, the last one past every expert's.
    assert pairs.tolist() == [0, 5, pad, pad, 1, 2, 6, 7, 3, 4, pad, pad] + [pad] * 8
    assert blocks.tolist() == [0, 2, 3, 4, 4]
    # Expert parallel: this rank holds global experts 2 and 3 only (local 0 and 1).
    pairs, blocks = kernels.align_pairs(ids, 4, 2, 2)
    assert pairs.tolist() == [1, 2, 6, 7, 3, 4, pad, pad] + [pad] * 8
    assert blocks.tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference_top1_and_top2_with_idle_experts(kernels: ModuleType, dtype: torch.dtype) -> None:
    # 5 tokens of 8 experts (16-row blocks), top-1, experts 1, 4 and 6 idle; 13 tokens of 6 (64-row blocks),
    # top-2, experts 2 and 4 idle. Intermediate size 24 and hidden 40: partial column and K blocks.
    _check(kernels, _experts(0, 5, 40, 24, 8, 1, used=[0, 2, 3, 5, 7]), dtype)
    _check(kernels, _experts(1, 13, 40, 24, 6, 2, used=[0, 1, 3, 5]), dtype)


def test_matches_reference_top3_more_pairs_than_a_block(kernels: ModuleType) -> None:
    # 30 tokens x 3 slots over 4 experts: 90 pairs, experts with more than one 64-row block.
    _check(kernels, _experts(2, 30, 32, 16, 4, 3), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_drops_the_ids_held_elsewhere(kernels: ModuleType, dtype: torch.dtype) -> None:
    e = _experts(3, 11, 32, 24, 8, 2)
    e.ids[0] = torch.tensor([0, 1])   # none of token 0's experts is held here
    e.ids[1] = torch.tensor([5, 4])   # both of token 1's are
    out = _check(kernels, e, dtype, expert_start=4, num_local=3)
    assert torch.equal(out[0], torch.zeros(32, dtype=dtype)) and out[1].abs().sum() > 0
    # A rank that holds none of the step's experts adds nothing.
    e.ids = e.ids % 4
    assert torch.equal(_check(kernels, e, dtype, expert_start=4, num_local=4), torch.zeros(11, 32, dtype=dtype))


def test_no_tokens(kernels: ModuleType) -> None:
    e = _experts(4, 0, 32, 16, 4, 2)
    out = kernels.fused_moe(e.x, e.w13, e.w2, e.weights, e.ids)
    assert out.shape == (0, 32)


def test_rejects_mixed_dtypes(kernels: ModuleType) -> None:
    e = _experts(5, 3, 32, 16, 4, 2)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.fused_moe(e.x, e.w13.half(), e.w2.half(), e.weights, e.ids)


@pytest.mark.parametrize("expert_start,num_local", [(0, 6), (2, 3)])
def test_triton_method_matches_grouped_method(kernels: ModuleType, expert_start: int, num_local: int) -> None:
    from engine.models.layers.fused_moe_triton import TritonMoEMethod

    routing = Routing(num_experts=6, top_k=2, renormalize=True)
    layer = FusedMoE(routing, hidden_size=32, intermediate_size=16, expert_start=expert_start,
                     num_local_experts=num_local)
    e = _experts(6, 9, 32, 16, num_local, 2)
    layer.w13.data.copy_(e.w13)
    layer.w2.data.copy_(e.w2)
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(7))
    expected = GroupedMoEMethod(layer, onednn=False).apply(layer, e.x, logits)
    layer.method = TritonMoEMethod()
    torch.testing.assert_close(layer(e.x, logits), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_on_cuda_matches_reference(kernels: ModuleType) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # decode-sized (fewer tokens than experts: 16-row blocks) and prefill-sized steps, some experts idle
        _check(kernels, _experts(10, 3, 256, 192, 64, 8), dtype, "cuda")
        _check(kernels, _experts(11, 300, 256, 192, 16, 4, used=list(range(0, 16, 2)) + [1]), dtype, "cuda")
        _check(kernels, _experts(12, 77, 128, 96, 16, 2), dtype, "cuda", expert_start=5, num_local=6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_on_cuda_replays_in_a_cuda_graph(kernels: ModuleType) -> None:
    # No host read: the step captures, and a replay over new routing computes the new step.
    first, second = _experts(13, 8, 128, 64, 32, 4), _experts(14, 8, 128, 64, 32, 4)
    d, new = first.to("cuda", torch.bfloat16), second.to("cuda", torch.bfloat16)
    kernels.fused_moe(d.x, d.w13, d.w2, d.weights, d.ids)   # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe(d.x, d.w13, d.w2, d.weights, d.ids)
    for src, dst in ((new.x, d.x), (new.weights, d.weights), (new.ids, d.ids)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    expected = moe_reference(d.x.cpu(), d.w13.cpu(), d.w2.cpu(), d.weights.cpu(), d.ids.cpu())
    torch.testing.assert_close(out.cpu().float(), expected, atol=6e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_cuda_device_chooses_the_triton_kernels(kernels: ModuleType) -> None:
    from engine.device import get_device

    assert get_device("cuda").kernel_choice(torch.bfloat16).triton_moe
