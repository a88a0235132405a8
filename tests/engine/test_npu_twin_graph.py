"""The operator twin's graph mode (tests/engine/npu_twin/graph.py) keeps torch-npu's documented semantics, the ones a
caller can get wrong: a replay recomputes from what the captured tensors hold (data copied in is used, a tensor
rebound to a name is not), the capture itself computes nothing, host values are frozen at capture (a paged attention
replays its capture-time context lengths) until a task update replaces them, a captured ExternalEvent wait needs a
record before every replay, and host reads or synchronisation while capturing are refused."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

npu = twin.npu
pytestmark = pytest.mark.usefixtures("torch_npu_twin")   # the twin's records cleared for each test


def _half(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).half()


def test_replay_recomputes_from_what_the_captured_tensors_hold() -> None:
    x = torch.zeros(4)
    g = npu.NPUGraph()
    with npu.graph(g):
        y = x * 2 + 1
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))   # into the captured input: the replay reads it
    g.replay()
    assert y.tolist() == [3.0, 5.0, 7.0, 9.0]
    x = torch.full((4,), 100.0)   # a new tensor under the old name: the graph never sees it
    g.replay()
    assert y.tolist() == [3.0, 5.0, 7.0, 9.0] and g.replays == 2
    assert npu.CAPTURED == [g] and g.kernels == ["aten.mul", "aten.add"]


def test_a_capture_computes_nothing() -> None:
    x, total = torch.ones(3), torch.zeros(3)
    g = npu.NPUGraph()
    with npu.graph(g):
        y = x + 1
        total.add_(y)   # a tensor that existed before the capture, written by a captured kernel
    assert torch.isnan(y).all() and total.tolist() == [0.0, 0.0, 0.0]   # no result until a replay
    g.replay()
    assert y.tolist() == [2.0, 2.0, 2.0] and total.tolist() == [2.0, 2.0, 2.0]
    g.replay()
    assert total.tolist() == [4.0, 4.0, 4.0]


def _paged_args(lens: list[int]) -> dict[str, Any]:
    return dict(query=_half(2, 4, 16), key_cache=_half(4, 128, 2, 16), value_cache=_half(4, 128, 2, 16),
                num_kv_heads=2, num_heads=4, scale_value=0.25, block_table=torch.tensor([[1, 2], [3, 0]],
                                                                                       dtype=torch.int32),
                context_lens=torch.tensor(lens, dtype=torch.int32), out=torch.zeros(2, 4, 16, dtype=torch.float16))


def _eager(args: dict[str, Any], lens: list[int]) -> torch.Tensor:
    out = torch.zeros_like(args["out"])
    twin._npu_paged_attention(**{**args, "context_lens": torch.tensor(lens, dtype=torch.int32), "out": out})
    return out


def test_a_host_tensor_is_frozen_at_capture() -> None:
    args = _paged_args([3, 100])
    g = npu.NPUGraph()
    with npu.graph(g):
        twin._npu_paged_attention(**args)
    args["context_lens"].copy_(torch.tensor([200, 5], dtype=torch.int32))   # too late: read when captured
    g.replay()
    assert torch.equal(args["out"], _eager(args, [3, 100])) and not torch.equal(args["out"], _eager(args, [200, 5]))


def _captured_group(args: dict[str, Any]) -> tuple[Any, Any, Any]:
    """vLLM-Ascend's capture of a paged attention: an ExternalEvent wait and reset, the call in a task group."""
    g = npu.NPUGraph()
    event = npu.ExternalEvent()
    with npu.graph(g):
        stream = npu.current_stream()
        workspace = twin._npu_paged_attention_get_workspace(**args)
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        twin._npu_paged_attention(**args, workspace=workspace)
        handle = npu.graph_task_group_end(stream)
    assert g.kernels == ["_npu_paged_attention"]   # the workspace is sized on the host: no task
    return g, event, handle


def _update(args: dict[str, Any], handle: Any, event: Any, lens: list[int], op: Any = None) -> None:
    update = npu.Stream()
    with npu.stream(update):
        npu.graph_task_update_begin(update, handle)
        (op or twin._npu_paged_attention)(**{**args, "context_lens": torch.tensor(lens, dtype=torch.int32)})
        npu.graph_task_update_end(update)
        event.record(update)


def test_a_task_update_replaces_the_captured_host_values() -> None:
    args = _paged_args([3, 100])
    g, event, handle = _captured_group(args)
    before = args["out"].clone()
    _update(args, handle, event, [200, 5])
    assert torch.equal(args["out"], before)   # an update computes nothing
    g.replay()
    assert torch.equal(args["out"], _eager(args, [200, 5]))
    _update(args, handle, event, [7, 7])
    g.replay()
    assert torch.equal(args["out"], _eager(args, [7, 7]))


def test_a_captured_event_wait_needs_a_record_before_every_replay() -> None:
    args = _paged_args([3, 100])
    g, event, handle = _captured_group(args)
    with pytest.raises(RuntimeError, match="wait forever"):
        g.replay()
    _update(args, handle, event, [5, 5])
    g.replay()
    with pytest.raises(RuntimeError, match="wait forever"):   # the replay reset it
        g.replay()


def test_an_update_must_reissue_the_captured_operator_on_its_stream() -> None:
    args = _paged_args([3, 100])
    _, event, handle = _captured_group(args)
    with pytest.raises(RuntimeError, match="re-issued"):
        _update(args, handle, event, [5, 5], op=twin._npu_paged_attention_get_workspace)
    update = npu.Stream()
    npu.graph_task_update_begin(update, handle)
    with pytest.raises(RuntimeError, match="another stream"):
        twin._npu_paged_attention(**args)   # issued on the current stream, not the update's
    with pytest.raises(RuntimeError, match=r"re-issued \[\]"):   # and the update re-issued nothing
        npu.graph_task_update_end(update)


def _capture_refuses(body: Any, match: str) -> None:
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match=match):
        with npu.graph(g):
            body()


@pytest.mark.parametrize("case", ["item", "equal", "nonzero", "synchronize", "stream synchronize"])
def test_host_reads_and_synchronisation_are_refused_while_capturing(case: str) -> None:
    x = torch.ones(3)
    body = {"item": lambda: x.sum().item(), "equal": lambda: torch.equal(x, x), "nonzero": lambda: x.nonzero(),
            "synchronize": lambda: npu.synchronize(), "stream synchronize": lambda: npu.current_stream().synchronize()}
    _capture_refuses(body[case], "captur")


def test_graph_calls_out_of_place_are_refused() -> None:
    with pytest.raises(RuntimeError, match="not capturing"):
        npu.graph_task_group_begin(npu.current_stream())
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="default stream"):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()
    with npu.graph(g):
        torch.ones(2).mul(2)
    with pytest.raises(RuntimeError, match="reset"):
        g.capture_begin()
