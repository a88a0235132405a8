"""`make run` before the serving stack exists: one greedy chat through the offline API."""

from __future__ import annotations

import sys

from engine import LLM, SamplingParams


def main() -> None:
    question = " ".join(sys.argv[1:]) or "What is the capital of France?"
    llm = LLM()
    out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0.0, max_tokens=64))
    print(f"user: {question}\nassistant: {out[0].outputs[0].text}")


if __name__ == "__main__":
    main()
