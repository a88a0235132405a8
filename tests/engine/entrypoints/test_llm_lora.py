"""The offline API with LoRA adapters (vLLM's ``LLM(enable_lora=True)`` and ``lora_request=``), on a tiny random
Llama and PEFT adapters written by peft itself: a batch mixing three adapters and the base model gives each prompt
exactly its tokens alone and PEFT's greedy tokens; adapters never share prefix-cache blocks; every refusal."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedModel

from common.errors import InvalidRequestError
from engine import LLM, LoRARequest, SamplingParams
from engine.entrypoints.llm import BeamSearchParams
from tests.lora_factory import save_adapter, save_tiny_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 17, 33, 9], [1, 8, 21, 64, 30, 99], [1, 15, 25, 35], [1, 40, 41, 42, 43, 44, 45],
           [1, 90, 3, 77], [1, 12, 12, 60, 61], [1, 100, 101, 102, 103, 104], [1, 70, 6, 52, 11]]


@dataclass
class Setup:
    model_dir: Path
    base: PreTrainedModel
    adapters: dict[str, tuple[LoRARequest, torch.nn.Module]]   # name -> (request, PeftModel)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("llm_lora")
    model_dir = root / "base"
    base = save_tiny_model(model_dir, "llama")
    # A word-level tokenizer over the model's 128 ids ("w5" is id 5), so that the offline API can load one.
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    specs = {"sql": dict(r=8, alpha=16, targets=("q_proj", "v_proj"), seed=11),
             "chat": dict(r=16, alpha=32, seed=12),
             "late": dict(r=16, alpha=8, use_rslora=True, targets=("o_proj", "gate_proj", "down_proj"), seed=13)}
    adapters: dict[str, tuple[LoRARequest, torch.nn.Module]] = {}
    for lora_id, (name, spec) in enumerate(specs.items(), start=1):
        peft_model = save_adapter(base, root / name, **spec)  # type: ignore[arg-type]
        adapters[name] = (LoRARequest(name, lora_id, str(root / name)), peft_model)
    return Setup(model_dir, base, adapters)


@pytest.fixture(scope="module")
def llm(setup: Setup) -> LLM:
    # Two slots for three adapters (the scheduler holds one back), and two kept in host memory (one is read again).
    return LLM(str(setup.model_dir), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, seed=0,
               enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)


def greedy(model: torch.nn.Module, prompt: list[int], n: int = 8) -> list[int]:
    """The reference model's greedy continuation (argmax of its float32 logits)."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_a_batch_over_three_adapters_and_the_base_gives_each_prompt_its_tokens_alone(llm: LLM, setup: Setup) -> None:
    order = ["sql", "chat", "late", None] * 2
    loras = [None if name is None else setup.adapters[name][0] for name in order]
    refs = [setup.base if name is None else setup.adapters[name][1] for name in order]
    expected = [greedy(ref, p) for ref, p in zip(refs, PROMPTS)]
    # Each adapter changes the answer (else this test could not fail).
    for i, name in enumerate(order[:3]):
        assert expected[i] != greedy(setup.base, PROMPTS[i]), name
    alone = [llm.generate([p], GREEDY, lora_request=lora)[0].outputs[0].token_ids for p, lora in zip(PROMPTS, loras)]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)]
    assert alone == expected
    assert together == expected
    # One adapter for every prompt.
    sql = setup.adapters["sql"]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, lora_request=sql[0])] == \
        [greedy(sql[1], p) for p in PROMPTS[:3]]
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_the_same_prompt_under_two_adapters_never_hits_the_others_blocks(llm: LLM, setup: Setup) -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]   # three full blocks of 4 can be served
    sched = llm.engine.scheduler
    sql, chat = setup.adapters["sql"][0], setup.adapters["chat"][0]
    first: dict[str, list[int]] = {}
    for name, lora in (("base", None), ("sql", sql), ("chat", chat)):
        hits = sched.prefix_cache_hits
        first[name] = llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        assert sched.prefix_cache_hits == hits, name
    assert first["sql"] != first["base"] and first["chat"] != first["sql"]
    for name, lora in (("sql", sql), ("base", None), ("chat", chat)):
        hits = sched.prefix_cache_hits
        again = llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        assert sched.prefix_cache_hits - hits == 12, name
        assert again == first[name], name


def test_chat_and_beam_search_take_a_lora_request(llm: LLM, setup: Setup) -> None:
    late, late_ref = setup.adapters["late"]
    prompt = [5, 17, 33, 9]
    expected = greedy(late_ref, prompt, 5)
    chat = llm.chat([{"role": "user", "content": "w5 w17 w33 w9"}], SamplingParams(temperature=0.0, max_tokens=5,
                                                                                     ignore_eos=True),
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}", lora_request=late)
    assert chat[0].prompt_token_ids == prompt and chat[0].outputs[0].token_ids == expected
    [beams] = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True),
                              lora_request=[late])
    assert beams.sequences[0].tokens == prompt + expected


def test_an_id_reused_for_another_folder_is_refused(llm: LLM, setup: Setup) -> None:
    sql, chat = setup.adapters["sql"][0], setup.adapters["chat"][0]
    llm.generate([PROMPTS[0]], GREEDY, lora_request=sql)
    impostor = LoRARequest("impostor", sql.lora_int_id, chat.lora_path)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, impostor])
    assert e.value.field == "lora_request"
    assert e.value.message == (f"lora_int_id 1 already names the adapter at {sql.lora_path!r}, not "
                               f"{chat.lora_path!r}: give each adapter its own lora_int_id")
    assert not llm.engine.has_unfinished_requests()   # the prompt added before it was taken back


def test_a_folder_that_is_no_adapter_is_refused_naming_the_file(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("empty", 99, str(tmp_path)))
    assert "adapter_config.json" in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_one_lora_request_per_prompt_or_one_for_all(llm: LLM, setup: Setup) -> None:
    sql = setup.adapters["sql"][0]
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPTS[:3], GREEDY, lora_request=[sql, None])
    assert (e.value.field, e.value.message) == ("lora_request", "got 2 LoRA requests for 3 prompts")
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPTS[:1], GREEDY, lora_request=["sql"])  # type: ignore[list-item]
    assert (e.value.field, e.value.message) == ("lora_request", "expected a LoRARequest or None, got str")


def test_lora_arguments_and_requests_need_enable_lora(setup: Setup) -> None:
    with pytest.raises(InvalidRequestError) as e:
        LLM(str(setup.model_dir), max_loras=2)
    assert (e.value.field, e.value.message) == ("max_loras", "needs enable_lora=True")
    plain = LLM(str(setup.model_dir), dtype="float32", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError) as e:
        plain.generate([PROMPTS[0]], GREEDY, lora_request=setup.adapters["sql"][0])
    assert (e.value.field, e.value.message) == ("lora_request",
                                                "LoRA is not enabled: start the engine with --enable-lora "
                                                "(offline: LLM(..., enable_lora=True))")
    assert not plain.engine.has_unfinished_requests()
