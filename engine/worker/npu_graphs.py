"""torch-npu's paged attention in NPU graphs of decode steps (``engine.worker.graphs``), as vLLM-Ascend's full
decode-only ACL graph captures it (``vllm_ascend/attention/attention_v1.py`` ``full_graph_pa`` and
``update_graph_params``, ``compilation/acl_graph.py``).

Everything a decode step runs on the NPU reads device tensors, which a graph replays over its fixed buffers —
except ``_npu_paged_attention``'s context lengths: a host tensor the operator reads when its task is built, so a
plain capture freezes the capture-time lengths into every replay. So each layer's call is captured in a task group
of its own (``torch.npu.graph_task_group_begin`` / ``_end``), behind an ``ExternalEvent`` the graph waits on, and
before each replay the step's lengths are written into every layer's task on an update stream
(``graph_task_update_begin``, the same call with the new lengths, ``graph_task_update_end``), each followed by a
record of its event. The lengths are the step's; the padding rows past its batch get 1 (the operator takes lengths
of at least 1) and read one key of whatever block their stale table row names, into output rows that are dropped.

Why not piecewise graphs (the model captured between attention calls, attention run eagerly), vLLM-Ascend's other
mode: they need the forward cut at every attention layer, many graphs per bucket (stream resources are the limit
vLLM-Ascend warns about), and still launch two operators per layer from the host; the task update keeps one graph
and one launch per step. Its cost is a host synchronisation of the compute stream before each update (as
vLLM-Ascend's ``ACLGraphWrapper`` does): an update must not reach the tasks of a replay still running.

Sliding-window layers (``npu_fused_infer_attention_score`` with host list lengths) are not captured: such models run
eagerly (``graphs_off_reason``). NOT RUN ON ASCEND HARDWARE: checked against the operator twin's graph mode
(tests/engine/npu_twin/graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.npu_backend import NpuAttentionBackend, NpuAttentionMetadata

if TYPE_CHECKING:
    from engine.worker.graphs import DecodeGraphs

# The context length vLLM-Ascend captures its paged-attention graphs with (model_runner_v1.py
# SEQ_LEN_WITH_MAX_PA_WORKSPACE): _npu_paged_attention_get_workspace then sizes the largest workspace, which the
# task updates reuse.
SEQ_LEN_WITH_MAX_PA_WORKSPACE = 6144


def npu_off_reason(backend: AttentionBackend) -> str | None:
    """Why ``backend`` cannot be captured on the NPU, or None."""
    if not isinstance(backend, NpuAttentionBackend):
        return f"{type(backend).__name__} is not the NPU attention backend"
    return None


@dataclass
class PagedAttentionTask:
    """One layer's captured ``_npu_paged_attention`` (its task group) and the arguments an update re-issues."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    scale: float
    block_table: torch.Tensor
    out: torch.Tensor
    workspace: torch.Tensor
    handle: Any   # graph_task_group_end's
    event: Any    # the torch.npu.ExternalEvent the task waits on


class CapturingNpuBackend(NpuAttentionBackend):
    """The backend of a decode graph's metadata: while the stream captures, each layer's paged attention goes into
    a task group of its own, noted in ``tasks``; otherwise (the run before capture) it runs as usual."""

    def __init__(self, ops: Any, tasks: list[PagedAttentionTask]) -> None:
        super().__init__(ops)
        self.tasks = tasks
        self.workspace: torch.Tensor | None = None   # one for all layers of the graph, as vLLM-Ascend keeps

    def paged_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: NpuAttentionMetadata, scale: float, out: torch.Tensor) -> None:
        npu = self.ops.npu
        if not npu.is_current_stream_capturing():
            super().paged_decode(query, key_cache, value_cache, meta, scale, out)
            return
        table, lens = meta.decode_block_table, meta.decode_context_lens
        if self.workspace is None:
            self.workspace = self.ops._npu_paged_attention_get_workspace(
                query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=key_cache.shape[2],
                num_heads=query.shape[1], scale_value=scale, block_table=table, context_lens=lens, out=out)
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        self.ops._npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache,
                                      num_kv_heads=key_cache.shape[2], num_heads=query.shape[1], scale_value=scale,
                                      block_table=table, context_lens=lens, out=out, workspace=self.workspace)
        handle = npu.graph_task_group_end(stream)
        self.tasks.append(PagedAttentionTask(query, key_cache, value_cache, scale, table, out, self.workspace,
                                             handle, event))


class NpuGraphAttention:
    """int32 slot and block-table buffers (the operators' dtype); the paged attention's context lengths written
    into its captured tasks before each replay."""

    index_dtype = torch.int32

    def __init__(self, backend: NpuAttentionBackend) -> None:
        self.ops = backend.ops
        self.tasks: dict[int, list[PagedAttentionTask]] = {}   # by bucket: one per layer, in call order
        self.update_stream = self.ops.npu.Stream()

    def metadata(self, graphs: DecodeGraphs, size: int) -> AttentionMetadata:
        """Decode-only metadata over the buffers; the context lengths (host) are the capture's, replaced by the
        task updates, long enough for the largest workspace."""
        tasks = self.tasks[size] = []
        table = graphs.block_tables[:size]
        length = min(SEQ_LEN_WITH_MAX_PA_WORKSPACE, graphs.width * graphs.block_size)
        return NpuAttentionMetadata(
            slot_mapping=graphs.slots[:size], block_tables=table, seq_lens=graphs.seq_lens[:size],
            query_lens=[1] * size, seq_lens_host=[length] * size, num_decodes=size, block_size=graphs.block_size,
            backend=CapturingNpuBackend(self.ops, tasks), slots=graphs.slots[:size], block_table=table,
            decode_block_table=table, decode_context_lens=torch.full((size,), length, dtype=torch.int32),
            prefill_block_table=table[size:], query_ends=list(range(1, size + 1)), kv_lens=[length] * size)

    def before_replay(self, graphs: DecodeGraphs, size: int, meta: AttentionMetadata) -> None:
        """The step's context lengths (padding rows: 1) into every layer's paged-attention task of the bucket."""
        npu = self.ops.npu
        lens = torch.tensor(meta.seq_lens_host + [1] * (size - meta.num_seqs), dtype=torch.int32)   # host
        npu.current_stream().synchronize()   # the previous replay has read its tasks
        update = self.update_stream
        with npu.stream(update):
            for task in self.tasks[size]:
                npu.graph_task_update_begin(update, task.handle)
                self.ops._npu_paged_attention(query=task.query, key_cache=task.key_cache,
                                              value_cache=task.value_cache, num_kv_heads=task.key_cache.shape[2],
                                              num_heads=task.query.shape[1], scale_value=task.scale,
                                              block_table=task.block_table, context_lens=lens, out=task.out,
                                              workspace=task.workspace)
                npu.graph_task_update_end(update)
                task.event.record(update)
