"""The ``sluice`` command: one entry point for every process of the stack.

  sluice serve      engine + tokenizer service(s) + gateway(s), supervised (what `make run` runs)
  sluice engine     the engine process (token-level gRPC)
  sluice tokenizer  the tokenizer service (public text-level gRPC)
  sluice gateway    the OpenAI-compatible REST gateway
  sluice bench      the serving benchmark
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "serve": "services.supervisor",
    "engine": "engine.entrypoints.cli",
    "tokenizer": "services.tokenizer.__main__",
    "gateway": "gateway.__main__",
    "bench": "benchmarks.bench",
}
_BENCH_EXTRA = ("aiohttp", "httpx", "matplotlib")  # pyproject's `bench` extra


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in _COMMANDS:
        print(__doc__.strip())
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    try:
        module = importlib.import_module(_COMMANDS[args[0]])
    except ModuleNotFoundError as e:
        if args[0] != "bench" or e.name not in _BENCH_EXTRA:
            raise
        print(f"sluice bench needs {e.name}: pip install 'sluice[bench]'", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(module.main(args[1:]))


if __name__ == "__main__":
    main()
