"""``LLM(model, speculative_config=...)`` as vLLM's: a dict of ``--speculative-config``'s keys, or a
SpeculativeConfig, reaches the engine; a bad one is refused naming the key before any model loads. (What
speculation does to outputs is tested with the engine core.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from common.errors import InvalidRequestError
from engine.config import SpeculativeConfig
from engine.entrypoints.llm import LLM
from tests.lora_factory import make_tiny_model

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama").save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("given", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}, NGRAM])
def test_the_config_reaches_the_engine(model_dir: Path, given: object) -> None:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, speculative_config=given)  # type: ignore[arg-type]
    assert llm.config.speculative_config == NGRAM
    assert llm.engine.spec_stats is not None and llm.engine.spec_stats.num_spec_tokens == 3


def test_off_by_default_and_refused_naming_the_key(model_dir: Path) -> None:
    assert LLM(str(model_dir), dtype="float32", num_kv_blocks=16).engine.spec_stats is None
    for given, field in (({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
                         ({"num_speculative_tokens": 3, "typo": 1}, "speculative_config.typo"),
                         ('{"num_speculative_tokens": 3}', "speculative_config")):
        with pytest.raises(InvalidRequestError) as e:
            LLM(str(model_dir), speculative_config=given)  # type: ignore[arg-type]
        assert e.value.field == field
