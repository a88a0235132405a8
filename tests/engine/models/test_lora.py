"""LoRA through the engine's executor (worker, model runner, LoRA manager, the LoRA linear method) against PEFT's
``PeftModel``: float32 logits of a prefill and 20 greedy decode steps on tiny random Llama and Qwen2 checkpoints
with random adapters; a mixed batch of adapters and base rows gives each row what it gets alone."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from common.errors import InvalidRequestError
from engine.config import EngineConfig, LoRAConfig
from engine.core.lora_request import LoRARequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.executor.uniproc import UniprocExecutor
from engine.models.layers.linear import Linear, linear_methods
from engine.models.layers.lora import LoRALinearMethod, LoRAStepPlan, LoRAStepState
from tests.lora_factory import ALL_TARGETS, save_adapter, save_tiny_model

TOL = 1e-4  # fp32 vs fp32: only summation order differs
VOCAB = 128
BLOCK = 4


class Driver:
    """Runs hand-built steps on an executor: each request gets fresh blocks, the runner's sampled token is
    appended, and the logits of each step's sampled rows are recorded."""

    def __init__(self, executor: UniprocExecutor) -> None:
        self.executor = executor
        self.next_block = 1
        runner = executor.worker.runner
        assert runner is not None
        model = runner.stage.model
        compute = model.compute_logits
        self.logits: list[torch.Tensor] = []

        def recording(hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
            out = compute(hidden, dtype)
            self.logits.append(out.float().clone())
            return out

        model.compute_logits = recording  # type: ignore[method-assign]

    def step(self, items: list[tuple[Request, int]]) -> torch.Tensor:
        """One step computing the next ``n`` tokens of each request (decodes first); the sampled rows' logits."""
        scheduled = []
        for req, n in items:
            need = (req.num_computed_tokens + n + BLOCK - 1) // BLOCK
            while len(req.block_ids) < need:
                req.block_ids.append(self.next_block)
                self.next_block += 1
            scheduled.append(ScheduledRequest.of(req, n))
        out = self.executor.execute_model(SchedulerOutput(scheduled=scheduled,
                                                          num_batched_tokens=sum(n for _, n in items)))
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.sample:
                s.request.append_output_token(out.sampled[s.request.seq_id][0])
        return self.logits.pop()


def _executor(model_path: Path, max_loras: int = 3, max_lora_rank: int = 16, **lora: object) -> UniprocExecutor:
    config = EngineConfig(model=str(model_path), dtype="float32", block_size=BLOCK, num_kv_blocks=512,
                          lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                                                 **lora))  # type: ignore[arg-type]
    executor = UniprocExecutor(config)
    executor.initialize_cache({2})
    return executor


def _request(rid: str, prompt: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), lora_request=lora)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def _patterned_adapter(base: PreTrainedModel, path: Path) -> PeftModel:
    """An adapter whose ranks and alphas differ by module (PEFT's rank_pattern / alpha_pattern)."""
    import copy
    torch.manual_seed(5)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        rank_pattern={"v_proj": 4, "model.layers.1.mlp.down_proj": 12},
                        alpha_pattern={"layers.0.self_attn.q_proj": 40, "down_proj": 3}, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(path)
    return peft_model.eval()


ADAPTERS: dict[str, Callable[[PreTrainedModel, Path], PeftModel]] = {
    "r8-qv": lambda base, p: save_adapter(base, p, r=8, alpha=16, targets=("q_proj", "v_proj"), seed=3),
    "r16-all": lambda base, p: save_adapter(base, p, r=16, alpha=32, targets=ALL_TARGETS, seed=4),
    "r16-rslora-mlp": lambda base, p: save_adapter(base, p, r=16, alpha=8, targets=("gate_proj", "up_proj",
                                                                                    "down_proj", "o_proj"),
                                                   seed=6, use_rslora=True, scale=0.3),
    "patterns": _patterned_adapter,
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[PreTrainedModel, dict[str, tuple[LoRARequest, PeftModel]], UniprocExecutor]]:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = save_tiny_model(root / "model", arch)
    adapters = {}
    for i, (name, make) in enumerate(ADAPTERS.items()):
        path = root / name
        adapters[name] = (LoRARequest(name, i + 1, str(path)), make(base, path))
    yield base, adapters, _executor(root / "model", max_loras=2, max_cpu_loras=2)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_prefill_and_20_greedy_decodes_match_peft(
        setup: tuple[PreTrainedModel, dict[str, tuple[LoRARequest, PeftModel]], UniprocExecutor],
        adapter: str) -> None:
    base, adapters, executor = setup
    lora, reference = adapters[adapter]
    driver = Driver(executor)
    prompt = _prompt(11, seed=7)
    req = _request("a", prompt, lora)
    logits = driver.step([(req, len(prompt))])
    expected = _reference_logits(reference, prompt)
    torch.testing.assert_close(logits[0], expected, atol=TOL, rtol=0)
    # The adapter moves the logits far past the tolerance: a delta dropped or misplaced would fail.
    assert (expected - _reference_logits(base, prompt)).abs().max() > 100 * TOL
    for _ in range(20):   # 31 tokens in blocks of 4
        logits = driver.step([(req, 1)])
        ids = prompt + req.output_token_ids[:-1]
        torch.testing.assert_close(logits[0], _reference_logits(reference, ids), atol=TOL, rtol=0)
        assert req.output_token_ids[-1] == int(logits[0].argmax())
    assert len(req.output_token_ids) == 21


def test_mixed_batch_gives_each_request_its_solo_tokens(
        setup: tuple[PreTrainedModel, dict[str, tuple[LoRARequest, PeftModel]], UniprocExecutor]) -> None:
    # 8 requests over the base model and 2 adapters (max_loras = 2) in one batch, admitted over two steps so that
    # steps mix decodes and prefills of different adapters; the same 8 run one at a time.
    base, adapters, executor = setup
    loras = [None, adapters["r8-qv"][0], adapters["r16-all"][0]]
    specs = [(f"r{i}", _prompt(5 + i, seed=20 + i), loras[i % 3]) for i in range(8)]
    driver = Driver(executor)
    batch = [_request(rid, prompt, lora) for rid, prompt, lora in specs]
    logits: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in batch}

    def step(items: list[tuple[Request, int]]) -> None:
        for (req, _), row in zip(items, driver.step(items)):
            logits[req.request_id].append(row)

    first, second = batch[:4], batch[4:]
    step([(r, r.num_prompt_tokens) for r in first])
    step([(r, 1) for r in first] + [(r, r.num_prompt_tokens) for r in second])
    for _ in range(8):
        step([(r, 1) for r in batch])
    for req, (rid, prompt, lora) in zip(batch, specs):
        alone = _request(rid, prompt, lora)
        solo = [driver.step([(alone, len(prompt))])[0]]
        solo += [driver.step([(alone, 1)])[0] for _ in range(len(logits[rid]) - 1)]
        assert req.output_token_ids == alone.output_token_ids, rid
        torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(solo), atol=1e-5, rtol=0)
        # Each adapter row really ran its adapter: its logits are far from the base model's on the same tokens.
        if lora is not None:
            ids = prompt + req.output_token_ids[:-1]
            plain = _request(rid, ids)
            base_logits = driver.step([(plain, len(ids))])[0]
            assert (base_logits - logits[rid][-1]).abs().max() > 0.05, rid


def test_lora_off_leaves_the_model_unwrapped_and_refuses_adapters(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model", "llama")
    executor = UniprocExecutor(EngineConfig(model=str(tmp_path / "model"), dtype="float32", num_kv_blocks=16))
    assert executor.worker.lora is None
    assert "LoRALinearMethod" not in linear_methods(executor.worker.model)
    with pytest.raises(InvalidRequestError) as e:
        executor.add_lora(LoRARequest("x", 1, str(tmp_path)))
    assert (e.value.field, e.value.message) == ("lora_request",
                                                "LoRA is not enabled on this engine: start it with --enable-lora")
    executor.remove_lora(1)   # nothing to forget: ignored


def test_lora_on_wraps_the_four_projections_of_every_layer(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model", "qwen2")
    executor = _executor(tmp_path / "model", max_loras=3, max_lora_rank=8)
    model = executor.worker.model
    assert linear_methods(model) == {"LoRALinearMethod": 8, **{k: v for k, v in linear_methods(model).items()
                                                               if k != "LoRALinearMethod"}}
    assert linear_methods(model)["LoRALinearMethod"] == 8   # 2 layers x (qkv, o, gate_up, down); not the lm_head
    qkv = model.layers[0].self_attn.qkv_proj.method
    assert isinstance(qkv, LoRALinearMethod)
    assert qkv.a.shape == (3 * 3 * 8, 64) and qkv.bt.shape == (3 * 3 * 8, 64 + 32 + 32)
    assert not isinstance(qkv.base, LoRALinearMethod)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_method_adds_each_rows_own_adapter_delta(dtype: torch.dtype) -> None:
    # A fused layer of 3 slices (10 | 6 | 6 rows), 2 slots of rank 4: slot 0 adapts slices 0 and 2 at rank 3,
    # slot 1 slice 1 at rank 4. Rows: slot 1, base, slot 0, slot 0.
    gen = torch.Generator().manual_seed(0)
    layer = Linear(8, 22, bias=True).to(dtype)
    state = LoRAStepState()
    method = LoRALinearMethod(layer.method, state, slices=(10, 6, 6), in_features=8, max_loras=2, max_rank=4,
                              dtype=dtype, device=torch.device("cpu"))
    layer.method = method

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    w0 = [(rand(3, 8), rand(10, 3)), None, (rand(3, 8), rand(6, 3))]
    w1 = [None, (rand(4, 8), rand(6, 4)), None]
    method.set_slot(0, w0)
    method.set_slot(1, w1)
    x = rand(4, 8)
    base = layer(x)                       # no step state: the base method's output as is
    state.set(LoRAStepPlan(torch.tensor([1, -1, 0, 0]), 2))       # every row masked
    out = layer(x)
    state.set(LoRAStepPlan(torch.tensor([1, -1]), 2, ((2, 4, 0),)))   # the last two rows as a chunk of slot 0
    torch.testing.assert_close(layer(x), out, atol=1e-5 if dtype == torch.float32 else 0.05, rtol=0)
    assert out.dtype == dtype
    expected = base.double().clone()
    for row, weights in ((0, w1), (2, w0), (3, w0)):
        start = 0
        for size, pair in zip((10, 6, 6), weights):
            if pair is not None:
                a, b = pair
                expected[row, start:start + size] += (x[row].double() @ a.double().T) @ b.double().T
            start += size
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=0 if dtype == torch.float32 else 0.02)
    assert torch.equal(out[1], base[1])   # the base row: exactly nothing added
    state.set(None)
    assert torch.equal(layer(x), base)
    method.clear_slot(0)
    # Rows are (slot, slice, rank): slot 0 (rows 0-11) is zeroed, slot 1's slice 1 (rows 16-19) stays.
    assert not method.a[0:12].any() and not method.bt[0:12].any()
    kept = w1[1]
    assert kept is not None and torch.equal(method.a[16:20], kept[0]) and torch.equal(method.bt[16:20, 10:16],
                                                                                       kept[1].t())
