"""The floor every server should beat: HF transformers ``generate`` on a static batch, offline, with the
default model loaded from its GGUF (dequantized, fp32) — output tokens/s at each batch size.

    python -m benchmarks.hf_floor --batch-sizes 1,32 --input-len 128 --output-len 128 --threads 2

Each batch is one ``generate`` call on prompts of exactly ``--input-len`` tokens (the benchmark's own
synthetic prompts, so no padding), forced to ``--output-len`` new tokens (``min_new_tokens``), greedy.
Throughput counts the whole call, prefill included, as a server's output tok/s does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import machine_info, utc_timestamp
from benchmarks.workload import synthetic_requests


def run(batch_sizes: list[int], input_len: int, output_len: int, threads: int | None, dtype: str,
        repeats: int) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import default_model_path

    if threads:
        torch.set_num_threads(threads)
    gguf = Path(default_model_path())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype)).eval()
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731 - exact sizes
    rows = []
    for bs in batch_sizes:
        specs = synthetic_requests(bs, (input_len, input_len), (output_len, output_len), seed=bs, count=count)
        ids = [tok(s.prompt, add_special_tokens=False)["input_ids"][:input_len] for s in specs]
        # Exact-length prompts keep the batch unpadded; a prompt that came out short is padded on the left.
        width = max(len(x) for x in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        times = []
        with torch.inference_mode():
            model.generate(input_ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4,
                           do_sample=False, pad_token_id=pad)  # warm-up: first-call allocations
            for _ in range(repeats):
                start = time.perf_counter()
                out = model.generate(input_ids, attention_mask=mask, max_new_tokens=output_len,
                                     min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
                times.append(time.perf_counter() - start)
        new = int(out.shape[1] - width)
        best = min(times)
        rows.append({"batch": bs, "prompt_tokens": width, "new_tokens": new, "seconds": times,
                     "output_tok_s": bs * new / best})
        print(f"batch {bs:>3}: {bs * new} tokens in {best:.2f} s -> {bs * new / best:.1f} out tok/s", flush=True)
    return {"system": f"transformers {transformers.__version__} generate, {dtype}", "threads": threads,
            "torch": torch.__version__, "timestamp": utc_timestamp(), "machine": machine_info(), "runs": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per batch size; the best is kept")
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    doc = run([int(b) for b in args.batch_sizes.split(",")], args.input_len, args.output_len, args.threads,
              args.dtype, args.repeats)
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
