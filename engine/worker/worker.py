"""The worker: one rank's device, its shard or stage of the model with its kernels chosen, its KV cache, and its
runner (the model runner on the driver, a :class:`StageRunner` that follows it on the other ranks)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from common.errors import InvalidRequestError
from engine.config import MTP_METHODS, EngineConfig
from engine.device import Device, get_device
from engine.distributed import ParallelContext, stage_layers
from engine.models import CausalLM, ModelConfig, load_model, resolve_dtype
from engine.models.layers.linear import linear_methods
from engine.models.loader import read_model_config
from engine.models.mtp import MtpModel, load_mtp
from engine.worker.graphs import capture_decode_graphs, graphs_off_reason
from engine.worker.kv_profile import kv_cache_budget, profile_step
from engine.worker.kv_pull import RemoteKVWorker
from engine.worker.kv_transfer import KVTransferWorker
from engine.worker.kv_transports import CacheLayout, KVSource, KVTransport, make_transport
from engine.worker.lora_manager import LoRAManager
from engine.worker.memory_budget import BlockBytes, MemoryBudget, module_bytes
from engine.worker.model_checks import check_model_options
from engine.worker.model_runner import ModelRunner, RunnerOutput
from engine.worker.sampler import Sampler
from engine.worker.spec_decode import Proposer
from engine.worker.spec_decode.draft_model import DraftModelProposer
from engine.worker.spec_decode.mtp import MtpProposer
from engine.worker.spec_decode.ngram import NgramProposer
from engine.worker.stage_runner import StageRunner
from engine.worker.step_inputs import StepInputs
from engine.worker.structured_output import GrammarVocabulary, StructuredOutputs

if TYPE_CHECKING:
    from engine.core.lora_request import LoRARequest

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 2**30


def prepare_model(model: CausalLM, device: Device, dtype: torch.dtype) -> None:
    """Every layer of a loaded model picks its kernel, once, from what ``device`` offers a ``dtype`` model."""
    choice = device.kernel_choice(dtype, model.amx_pack_bytes(), model.int8_linears)
    model.use_kernels(choice)
    methods = linear_methods(model)
    logger.info("linear layers: %s; fused norms and activations: %s",
                ", ".join(f"{n} {name.removesuffix('LinearMethod')}" for name, n in sorted(methods.items())),
                "cpu_ops" if choice.ops is not None else "PyTorch")


def load_draft_model(path: str, target: ModelConfig, dtype: torch.dtype, device: Device) -> CausalLM:
    """Speculative decoding's draft model, with its kernels chosen; refused (naming the sizes) unless its
    vocabulary is the target's: its proposals are token ids the target must read the same way."""
    try:
        draft = load_model(path, dtype, device.torch_device)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidRequestError("speculative_config.model", f"cannot load the draft model {path!r}: {e}") from e
    if draft.config.vocab_size != target.vocab_size:
        raise InvalidRequestError(
            "speculative_config.model", f"the draft model {path!r} has a vocabulary of {draft.config.vocab_size} "
                                        f"tokens and the target {target.vocab_size}: a draft model must share the "
                                        "target's vocabulary and tokenizer")
    prepare_model(draft, device, dtype)
    logger.info("speculative decoding: draft model %s (%d layers, hidden size %d)", path, draft.config.num_layers,
                draft.config.hidden_size)
    return draft


class Worker:
    """Loads this rank's part of the model on its device and runs the steps the executor hands it (the driver)
    or the driver publishes (the other ranks: ``init_stage``, then ``StageRunner.follow``)."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        parallel = parallel if parallel is not None else ParallelContext()
        # --enable-expert-parallel is a sharding plan of the experts over this replica's tensor ranks
        self.parallel = parallel = replace(parallel, expert_parallel=config.enable_expert_parallel)
        # Each rank of a replica on an accelerator has its own device: --device-ids (MindIE npuDeviceIds) in
        # rank order, else the rank's number.
        index = config.device_ids[parallel.rank] if config.device_ids is not None else parallel.rank
        self.device = get_device(config.device, num_threads=config.num_threads, kernels=config.kernels,
                                 index=index)
        self.device.set_seed(config.seed)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.kv_cache_dtype = (self.dtype if config.kv_cache_dtype == "auto"
                               else resolve_dtype(config.kv_cache_dtype, config.device))
        check_model_options(read_model_config(config.model_path), config)
        self.model = load_model(config.model_path, self.dtype, self.device.torch_device, parallel=parallel,
                                quantization=config.quantization)
        if config.disable_sliding_window:
            self.model.disable_sliding_window()
        if config.max_model_len is not None:
            self.model.fit_context(config.max_model_len)
        if (int8 := self.model.int8_linears) or config.quantization is not None:
            # A compressed-tensors checkpoint brings its own int8 weights; w8a8 quantized the float ones at load.
            logger.info("W8A8 int8: %d linears of this rank (quantization %s); the embedding stays %s",
                        int8, config.quantization or "from the checkpoint", str(self.dtype).removeprefix("torch."))
        prepare_model(self.model, self.device, self.dtype)
        # LoRA wraps the projections' chosen methods; off (None), the model carries no trace of it.
        lora = config.lora_config
        self.lora: LoRAManager | None = None
        if lora is not None:
            lora_dtype = self.dtype if lora.lora_dtype == "auto" else resolve_dtype(lora.lora_dtype, config.device)
            self.lora = LoRAManager(self.model, lora, lora_dtype, self.device.torch_device)
        self.draft: CausalLM | None = None   # speculative decoding's draft model
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and parallel.is_driver:   # unsharded, rank 0 only
            assert spec.model is not None
            self.draft = load_draft_model(spec.model, self.model.config, self.dtype, self.device)
            if config.max_model_len is not None:
                self.draft.fit_context(config.max_model_len)
        self.mtp: MtpModel | None = None    # the checkpoint's own multi-token prediction layers (unsharded)
        if spec is not None and spec.method in MTP_METHODS and parallel.is_driver:
            self.mtp = self._load_mtp(spec.method)
        self.runner: ModelRunner | None = None   # the driver's
        self.stage: StageRunner | None = None
        # Prefill/decode disaggregation: the KV transport, and where consumers reach a producer's cache (None: off).
        self.kv_transport: KVTransport | None = None
        self.kv_source: KVSource | None = None

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    def num_kv_blocks(self) -> int:
        """KV blocks for the configured memory (``--kv-cache-memory`` when given, as vLLM's
        ``--kv-cache-memory-bytes``, and 2 GiB on CPU without it; on accelerators a share of device memory less
        what the weights, a profiled max-size step's activations and other processes hold), or ``--num-kv-blocks``.
        The arithmetic is logged; a cache with no room for one block, or for one sequence of an asked-for
        ``--max-model-len``, is refused with it (``memory_budget``). Decided on the
        driver for every rank (they share block ids): by the rank whose blocks take the most bytes, the largest
        pipeline stage's or the driver's with its draft model."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        mc = self.model.config
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()

        def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, planes: int = 2) -> int:
            return planes * num_layers * cfg.block_size * num_kv_heads * head_dim * elem

        par = self.parallel
        largest_stage = max(end - start for start, end in (stage_layers(mc.num_layers, par.pp_size, s)
                                                            for s in range(par.pp_size)))
        # the same on every rank: its KV heads (or MLA's one latent) and their width, the model's real bytes
        heads, width, planes = self.model.num_local_kv_heads, self.model.kv_head_dim, self.model.kv_planes
        # A draft model (or the MTP layers) keeps its own keys and values under the same block ids.
        draft = (block_bytes(self.draft.config.num_layers, self.draft.config.num_kv_heads,
                             self.draft.config.head_dim) if self.draft is not None else 0)
        if self.mtp is not None:
            draft += (block_bytes(self.mtp.num_layers, 1, mc.mla.latent_dim, 1) if mc.mla is not None
                      else block_bytes(self.mtp.num_layers, mc.num_kv_heads, mc.head_dim))
        block = max(BlockBytes(planes, largest_stage, cfg.block_size, heads, width, elem),
                    BlockBytes(planes, self.model.num_local_layers, cfg.block_size, heads, width, elem, draft),
                    key=lambda b: b.total)
        weights, lora = module_bytes(self.model)
        draft_weights = sum(module_bytes(m)[0] for m in (self.draft, self.mtp) if isinstance(m, torch.nn.Module))
        held = (("weights", weights), ("LoRA slots", lora), ("draft model", draft_weights))
        field = "kv_cache_memory"
        if cfg.kv_cache_memory is not None or self.device.name == "cpu":   # vLLM's --kv-cache-memory-bytes
            given = (("--kv-cache-memory", cfg.kv_cache_memory) if cfg.kv_cache_memory is not None
                     else ("the CPU default (--kv-cache-memory)", _DEFAULT_CPU_KV_BYTES))
            budget = MemoryBudget(given, (), held, block, "held besides")
        elif par.world_size == 1:
            field = "device_memory_utilization"
            budget = self._profiled_budget(held, block)
        else:
            # The profile step's collectives would wait for ranks that are not running it: estimate instead.
            field = "device_memory_utilization"
            free, total = self.device.memory_info()
            budget = MemoryBudget((f"device {total} B x {cfg.device_memory_utilization:g} =",
                                   int(total * cfg.device_memory_utilization)),
                                  (("in use before the cache", total - free),
                                   (f"activations (estimated: {par.world_size} ranks, not profiled)",
                                    self._activation_reserve())), held, block, "counted in them")
        refusal = budget.refusal(cfg.max_model_len)
        if refusal is not None:
            raise InvalidRequestError(field if budget.num_blocks < 1 else "max_model_len", refusal)
        logger.info("%s", budget.summary(cfg.max_model_len, cfg.max_num_seqs))
        return budget.num_blocks

    def _profiled_budget(self, held: tuple[tuple[str, int], ...], block: BlockBytes) -> MemoryBudget:
        """The cache's bytes on a single-rank accelerator, from a profiled max-size step (``kv_profile``)."""
        cfg = self.config
        profile = profile_step(self.model, self.device, self.device.attention_backend(),
                               max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                               block_size=cfg.block_size, dtype=self.kv_cache_dtype)
        util = cfg.device_memory_utilization
        budget = MemoryBudget((f"device {profile.total} B x {util:g} =", int(profile.total * util)),
                              (("weights", profile.weights),
                               (f"activation peak (a {cfg.max_num_batched_tokens}-token step over --max-num-seqs "
                                f"{cfg.max_num_seqs})", profile.activations), ("other use", profile.others)),
                              held[1:], block, "counted in the weights")
        assert budget.kv_bytes == kv_cache_budget(profile, util)
        return budget

    def _activation_reserve(self) -> int:
        """Rough activation peak of a max-size step (several ranks, where no rank can profile alone): hidden
        states and logits in fp32, with headroom."""
        mc = self.model.config
        tokens = self.config.max_num_batched_tokens
        return (4 * tokens * (4 * mc.hidden_size + 2 * mc.intermediate_size)
                + 4 * self.config.max_num_seqs * mc.vocab_size * 2)

    def init_stage(self, num_blocks: int) -> StageRunner:
        """This rank's KV cache and the runner of its part of each step."""
        transfer = self.config.kv_transfer_config
        if transfer is not None:   # prefill/decode disaggregation: a producer's cache lives where consumers read it
            self.kv_transport = make_transport(transfer)
        memory = (self.kv_transport.cache_memory(self.device)
                  if self.kv_transport is not None and transfer is not None and transfer.is_producer else None)
        stage = StageRunner(self.model, self.device, num_blocks=num_blocks, block_size=self.config.block_size,
                            dtype=self.kv_cache_dtype, activation_dtype=self.dtype, cache_memory=memory)
        if self.kv_transport is not None and transfer is not None and transfer.is_producer:
            self.kv_source = KVSource(transfer.transport, self.kv_transport.publish(stage.kv_caches),
                                      CacheLayout.of(stage.kv_caches).text(), transfer.engine_id or "")
        stage.keep_hidden = self.mtp is not None   # the MTP proposer reads every token's hidden state
        eager = graphs_off_reason(self.config, self.device.name, self.parallel.world_size, stage.backend,
                                  self.model.config)
        if eager is None:
            free_before, _ = self.device.memory_info()
            stage.graphs = capture_decode_graphs(self.model, stage.backend, stage.kv_caches, self.config, self.device)
            # Captured after the cache is sized: the pools come out of the (1 - utilization) share left over.
            logger.info("decode graph pools: %d B (device memory taken by the capture)",
                        free_before - self.device.memory_info()[0])
        elif self.device.name != "cpu":
            logger.info("decode steps run eagerly: %s", eager)
        self.stage = stage
        return stage

    def init_runner(self, num_blocks: int, eos_token_ids: set[int],
                    grammar_vocabulary: GrammarVocabulary | None = None,
                    publish: Callable[[StepInputs], None] | None = None) -> ModelRunner:
        """The driver's runner. ``grammar_vocabulary``: the tokenizer llguidance masks with; None: no structured
        outputs. ``publish``: hands each step's inputs to the other ranks (None: there are none)."""
        mc = self.model.config
        sampler = Sampler(mc.vocab_size, eos_token_ids, seed=self.config.seed, argmax=self.device.row_argmax())
        so = self.config.structured_outputs_config
        structured = (StructuredOutputs(grammar_vocabulary, mc.vocab_size, eos_token_ids,
                                        disable_any_whitespace=so.disable_any_whitespace, overlap=so.overlap_masks)
                      if grammar_vocabulary is not None else None)
        self.runner = ModelRunner(self.init_stage(num_blocks), sampler, block_size=self.config.block_size,
                                  max_num_batched_tokens=self.config.max_num_batched_tokens,
                                  structured=structured, lora=self.lora, proposer=self._proposer(num_blocks),
                                  publish=publish)
        offload = self.config.kv_offloading_config
        if offload is not None:   # a KV offload tier's worker half (engine.worker.kv_transfer)
            self.runner.kv_transfer = KVTransferWorker(
                self.runner.stage.kv_caches, size_bytes=offload.size_bytes, backend=offload.backend,
                path=offload.path, pin=self.device.pin_memory, rank=self.parallel.rank,
                data_parallel_rank=self.config.data_parallel_rank, synchronize=self.device.synchronize)
        transfer = self.config.kv_transfer_config
        if transfer is not None and transfer.is_consumer and self.kv_transport is not None:
            self.runner.kv_transfer = RemoteKVWorker(self.runner.stage.kv_caches, self.kv_transport)
        return self.runner

    def close_kv_transport(self) -> None:
        """Stop serving and pulling KV blocks (prefill/decode disaggregation); idempotent."""
        transport, self.kv_transport = self.kv_transport, None
        if self.runner is not None and isinstance(self.runner.kv_transfer, RemoteKVWorker):
            self.runner.kv_transfer.close()   # its transport with it
            self.runner.kv_transfer = None
        elif transport is not None:
            transport.close()

    def _proposer(self, num_blocks: int) -> Proposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.mtp is not None:
            return MtpProposer(self.mtp, self.model, self.device, num_blocks=num_blocks,
                               block_size=self.config.block_size,
                               max_num_tokens=self.config.max_num_batched_tokens, dtype=self.kv_cache_dtype,
                               num_speculative_tokens=spec.num_speculative_tokens)
        if self.draft is not None:
            return DraftModelProposer(self.draft, self.device, num_blocks=num_blocks,
                                      block_size=self.config.block_size,
                                      max_num_tokens=self.config.max_num_batched_tokens, dtype=self.kv_cache_dtype,
                                      vocab_size=self.model.config.vocab_size,
                                      num_speculative_tokens=spec.num_speculative_tokens)
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)

    def _load_mtp(self, method: str) -> MtpModel:
        """The target checkpoint's MTP layers with their kernels chosen (InvalidRequestError naming the method when
        the checkpoint has none, or when they would need the target's sharded embedding)."""
        try:
            mtp = load_mtp(self.config.model_path, self.dtype, self.device.torch_device)
        except (OSError, ValueError, KeyError) as e:
            raise InvalidRequestError("speculative_config.method", f"{method}: {e}") from e
        if mtp.embed_tokens is None and self.parallel.tp_size > 1:
            raise InvalidRequestError("speculative_config.method",
                                      f"{method}: the checkpoint's MTP layers carry no embedding and lm_head of their "
                                      "own, and the target's are split over the tensor ranks")
        mtp.use_kernels(self.device.kernel_choice(self.dtype))
        logger.info("speculative decoding: %d MTP layer(s) of the checkpoint%s", mtp.num_layers,
                    "" if mtp.embed_tokens is not None else " (the target's embedding and lm_head)")
        return mtp

    def add_lora(self, lora: LoRARequest) -> None:
        """Reads and validates an adapter into the host cache (InvalidRequestError naming the file and field)."""
        if self.lora is None:
            raise InvalidRequestError("lora_request", "LoRA is not enabled on this engine: start it with --enable-lora")
        self.lora.add_lora(lora)

    def remove_lora(self, lora_id: int) -> None:
        """Forgets an adapter's weights (host copy and device slot); unknown ids are ignored."""
        if self.lora is not None:
            self.lora.remove_lora(lora_id)


__all__ = ["Worker", "RunnerOutput", "prepare_model"]
