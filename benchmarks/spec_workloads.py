"""Datasets for the speculative-decoding benchmark (docs/benchmarks.md): one whose answers repeat their prompts
(code edited in place, passages quoted back) and a plain chat control, as JSONL rows for ``benchmarks.bench
--dataset`` (``{"prompt": ..., "output_len": ...}``).

    python -m benchmarks.spec_workloads --out-dir /tmp/spec   # writes repeat.jsonl and chat.jsonl

Prompts are built from templates with a seeded generator, so every run (and every system) gets the same ones.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

_NAMES = ["total", "count", "items", "values", "result", "index", "buffer", "limit", "offset", "weight", "score",
          "price", "amount", "width", "height", "name", "label", "queue", "cache", "record"]
_OPS = ["+", "-", "*", "//", "%"]
_TOPICS = ["the history of the printing press", "how bees make honey", "why the sky is blue", "the water cycle",
           "how a bicycle stays upright", "the life of a star", "how vaccines work", "the invention of paper",
           "how tides happen", "why leaves change colour", "how a compass works", "the first railways"]
_FACTS = ["The river rises in the northern hills and flows south for three hundred kilometres.",
          "Farmers along its banks grow rice, beans and maize in the wet season.",
          "A stone bridge built in 1820 still carries traffic across the narrowest point.",
          "In spring the water turns brown with silt carried down from the mountains.",
          "Fishermen use small wooden boats and nets woven by hand.",
          "The town at the river mouth holds a market every Saturday morning.",
          "Floods in 1954 destroyed many houses, and a dam was built upstream afterwards.",
          "Herons, kingfishers and otters live among the reeds near the delta."]


def code_module(rng: random.Random) -> tuple[str, str, str]:
    """A small Python module and one of its function names, with a new name for it."""
    functions = []
    names = rng.sample(_NAMES, 6)
    for i in range(4):
        a, b, c = names[i], names[i + 1], names[i + 2]
        op1, op2 = rng.choice(_OPS), rng.choice(_OPS)
        functions.append(f"def compute_{a}({b}, {c}):\n    {a} = {b} {op1} {c}\n    if {a} > {rng.randint(2, 99)}:\n"
                         f"        {a} = {a} {op2} {rng.randint(2, 9)}\n    return {a}\n")
    old = f"compute_{names[rng.randint(0, 3)]}"
    return "\n\n".join(functions), old, old.replace("compute_", "calculate_")


def repeat_prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        if i % 2 == 0:
            code, old, new = code_module(rng)
            prompts.append(f"Rename the function {old} to {new} in this Python module and print the whole module "
                           f"with the change, nothing else.\n\n```python\n{code}```")
        else:
            passage = " ".join(rng.sample(_FACTS, 5))
            prompts.append(f"Quote the following passage word for word, then summarise it in one sentence.\n\n"
                           f"\"{passage}\"")
    return prompts


def chat_prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(['Explain', 'Describe', 'Tell me about'])} {rng.choice(_TOPICS)} in a few paragraphs."
            for _ in range(num)]


def write(path: Path, prompts: list[str], output_len: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "output_len": output_len}) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--num", type=int, default=64, help="prompts per dataset")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "repeat.jsonl", repeat_prompts(args.num, args.seed), args.output_len)
    write(out / "chat.jsonl", chat_prompts(args.num, args.seed), args.output_len)
    print(f"wrote {out / 'repeat.jsonl'} and {out / 'chat.jsonl'}")


if __name__ == "__main__":
    main()
