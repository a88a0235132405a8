"""A tool parser whose call markers are special tokens (Mistral's ``[TOOL_CALLS]``): the tokenizer service keeps
special tokens in the text by default for it, as vLLM does, and leaves the special token that ends the output (eos)
out of the text while still returning and counting its id."""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.text import Tokenizer
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tool_parsers import TOOL_PARSERS
from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2
from services.tokenizer.outputs import SequenceOutput, Usage

# Mistral's v11 layout: [TOOL_CALLS]name[ARGS]{arguments}; the words are joined as they are (a Fuse decoder).
WORDS = ["get_weather", '{"city": ', '"Paris"}']


def tokenizer(tmp_path: Path) -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("[TOOL_CALLS]", "[ARGS]", "</s>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(HFTokenizer.from_file(str(tmp_path / "tokenizer.json")), eos_token_id=hf.token_to_id("</s>"))


def run(tok: Tokenizer, ids: list[int], *, skip: bool, drop: bool) -> list[generation_pb2.GenerateResponse]:
    parser = TOOL_PARSERS["mistral"](["get_weather"])
    seq = SequenceOutput(0, tok, IncrementalDetokenizer(tok, [1], skip_special_tokens=skip), tools=parser.stream(),
                         drop_final_special=drop)
    usage = Usage(prompt=1)
    out = [seq.delta("r", engine_pb2.EngineGenerateResponse(token_ids=ids[:-2]), usage,
                     generation_pb2.ResponseOptions()),
           seq.delta("r", engine_pb2.EngineGenerateResponse(token_ids=ids[-2:],
                                                            finish_reason=common_pb2.FINISH_REASON_EOS),
                     usage, generation_pb2.ResponseOptions())]
    return [m for m in out if m is not None]


def test_the_calls_are_read_and_the_final_eos_is_not_text(tmp_path: Path) -> None:
    tok = tokenizer(tmp_path)
    calls_id, args_id, eos = (tok.backend.token_to_id(t) for t in ("[TOOL_CALLS]", "[ARGS]", "</s>"))
    assert {calls_id, args_id, eos} <= tok.all_special_ids
    word = tok.backend.token_to_id
    ids = [calls_id, word(WORDS[0]), args_id, word(WORDS[1]), word(WORDS[2]), eos]
    msgs = run(tok, ids, skip=False, drop=True)
    assert "".join(m.text for m in msgs) == ""
    assert [d.name for m in msgs for d in m.tool_calls if d.name] == ["get_weather"]
    assert "".join(d.arguments for m in msgs for d in m.tool_calls) == '{"city": "Paris"}'
    assert [t for m in msgs for t in m.token_ids] == ids   # the eos id is still returned and counted
    assert msgs[-1].usage.completion_tokens == len(ids)
    # without the drop, the eos token's text would end the answer; with special tokens skipped, no call is seen
    kept = run(tok, ids, skip=False, drop=False)
    assert "</s>" in "".join(m.text for m in kept)
    skipped = run(tok, ids, skip=True, drop=False)
    assert not any(m.tool_calls for m in skipped)
