"""Structured outputs, engine level: what a JSON schema costs a full batch, whether filling masks during the
forward pass hides them, and llguidance against xgrammar on the same schema and vocabulary.

    python -m benchmarks.structured_outputs [--num-seqs 32] [--max-tokens 64] [--xgrammar-path /tmp/xgr]

xgrammar is optional (``pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi``: no CUDA torch);
without it that part is skipped and says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from engine.config import EngineConfig, StructuredOutputsConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from engine.text import Tokenizer
from engine.worker.structured_output import GrammarVocabulary, StructuredOutputs

# An array of at least 8 records: no sequence can complete it in 64 tokens, so every run keeps the whole batch
# for max_tokens steps and the runs with and without the schema generate the same number of tokens.
ITEM = {"type": "object",
        "properties": {"name": {"type": "string"}, "role": {"enum": ["admin", "user", "guest"]},
                       "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "role", "age", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"users": {"type": "array", "items": ITEM, "minItems": 8}},
          "required": ["users"], "additionalProperties": False}
EXAMPLE = {"users": [{"name": f"user {i}", "role": "user", "age": 20 + i, "tags": ["a", "b"]} for i in range(8)]}


def run(core: EngineCore, tokenizer: Tokenizer, num_seqs: int, max_tokens: int, constrained: bool
        ) -> dict[str, float]:
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the users of a web site as JSON."}]), add_special_tokens=False)
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(num_seqs):
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                                         ignore_eos=True, structured_outputs=spec))
    structured = core.executor.worker.runner.structured  # type: ignore[union-attr]
    before = (structured.stats.steps, structured.stats.fill_s, structured.stats.wait_s) if structured else (0, 0, 0)
    tokens = 0
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    elapsed = time.perf_counter() - t0
    result = {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}
    if structured is not None and constrained:
        steps = structured.stats.steps - before[0]
        result["mask_fill_ms_per_step"] = 1e3 * (structured.stats.fill_s - before[1]) / steps
        result["mask_wait_ms_per_step"] = 1e3 * (structured.stats.wait_s - before[2]) / steps
    return result


def compare_backends(tokenizer: Tokenizer, vocab_size: int, eos: int, xgrammar_path: str | None
                     ) -> dict[str, Any]:
    """Compile time (uncached) and mean time of one mask along a valid 8-record document, llguidance vs xgrammar."""
    ids = tokenizer.encode(json.dumps(EXAMPLE), add_special_tokens=False)
    so = StructuredOutputs(GrammarVocabulary.from_tokenizer(tokenizer), vocab_size, {eos}, overlap=False)
    out: dict[str, Any] = {"tokens_walked": len(ids)}
    import llguidance
    import llguidance.torch

    t0 = time.perf_counter()
    matcher = so.compile(StructuredOutputsParams(json=SCHEMA)).deep_copy()
    out["llguidance_compile_ms"] = 1e3 * (time.perf_counter() - t0)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), matcher.get_error()
    out["llguidance_mask_ms"] = 1e3 * statistics.mean(times)
    out["llguidance_mask_p99_ms"] = 1e3 * sorted(times)[int(0.99 * len(times))]

    if xgrammar_path:
        sys.path.insert(0, xgrammar_path)
    try:
        import xgrammar as xgr
    except ImportError as e:
        out["xgrammar"] = f"not run: {e}"
        return out
    info = xgr.TokenizerInfo([tokenizer.token_to_bytes(i) for i in range(tokenizer.vocab_size)],
                             vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    out["xgrammar_compile_ms"] = 1e3 * (time.perf_counter() - t0)
    xm = xgr.GrammarMatcher(compiled)
    xmask = xgr.allocate_token_bitmask(1, vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        xm.fill_next_token_bitmask(xmask)
        times.append(time.perf_counter() - t0)
        assert xm.accept_token(t)
    out["xgrammar_mask_ms"] = 1e3 * statistics.mean(times)
    out["xgrammar_mask_p99_ms"] = 1e3 * sorted(times)[int(0.99 * len(times))]
    out["xgrammar_version"] = getattr(xgr, "__version__", "?")
    out["llguidance_version"] = llguidance.__version__
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--xgrammar-path", default=None, help="a --target directory xgrammar was installed into")
    ns = parser.parse_args()
    results: dict[str, Any] = {}
    tokenizer = Tokenizer.from_pretrained(EngineConfig().model_path)
    vocabulary = GrammarVocabulary.from_tokenizer(tokenizer)
    cores = {overlap: EngineCore(EngineConfig(dtype=ns.dtype, max_num_seqs=ns.num_seqs, kv_cache_memory=2**30,
                                              structured_outputs_config=StructuredOutputsConfig(overlap_masks=overlap)),
                                 grammar_vocabulary=vocabulary) for overlap in (True, False)}
    for core in cores.values():
        run(core, tokenizer, 4, 8, constrained=True)  # warm-up: compiles the schema, first steps
    # The three runs interleaved, --repeats times, medians reported: other jobs on a shared machine come and go.
    runs: dict[str, list[dict[str, float]]] = {"unconstrained": [], "json_schema_overlapped": [],
                                                "json_schema_serial": []}
    for _ in range(ns.repeats):
        runs["unconstrained"].append(run(cores[True], tokenizer, ns.num_seqs, ns.max_tokens, constrained=False))
        runs["json_schema_overlapped"].append(run(cores[True], tokenizer, ns.num_seqs, ns.max_tokens, True))
        runs["json_schema_serial"].append(run(cores[False], tokenizer, ns.num_seqs, ns.max_tokens, True))
        print(json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    for name, samples in runs.items():
        results[name] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    results["ratio_overlapped"] = (results["json_schema_overlapped"]["tokens_per_s"]
                                   / results["unconstrained"]["tokens_per_s"])
    results["ratio_serial"] = results["json_schema_serial"]["tokens_per_s"] / results["unconstrained"]["tokens_per_s"]
    mc_vocab = tokenizer.vocab_size
    results["backends"] = compare_backends(tokenizer, mc_vocab, 2 if tokenizer.eos_token_id is None
                                           else tokenizer.eos_token_id, ns.xgrammar_path)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
