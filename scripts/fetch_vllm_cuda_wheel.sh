#!/usr/bin/env bash
# Unpack vLLM's CUDA wheel (no dependencies, no driver needed) for the CUDA gate test:
#   scripts/fetch_vllm_cuda_wheel.sh [VERSION]   (default 0.32.0; ~311 MiB download, ~250 MiB unpacked)
# It lands in ${EDGE_VLLM_CUDA_WHEEL:-~/.cache/edge/vllm-cuda/VERSION}, with vllm/ inside: the Python
# sources and the one compiled extension whose messages the gate reads (_C_stable_libtorch.abi3.so);
# the other extensions are left out. plugins/edge_cuda/tests/test_cuda_gates_vllm.py runs vLLM's own
# selection functions from there.
set -euo pipefail
version="${1:-0.32.0}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/edge/vllm-cuda"
target="${EDGE_VLLM_CUDA_WHEEL:-$cache/$version}"
if [ -f "$target/vllm/platforms/cuda.py" ] && [ -f "$target/vllm/_C_stable_libtorch.abi3.so" ]; then
  echo "$target"; exit 0
fi
mkdir -p "$cache"
# pip from EDGE_FETCH_PYTHON when set (nox hands its own interpreter: a uv-made session venv has no pip).
"${EDGE_FETCH_PYTHON:-python3}" -m pip download -q --no-deps "vllm==$version" -d "$cache"
wheel=$(ls "$cache"/vllm-"$version"-*x86_64.whl | head -n 1)
rm -rf "$target.partial" && mkdir -p "$target.partial"
python3 - "$wheel" "$target.partial" <<'PY'
import sys, zipfile
wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    keep = [n for n in z.namelist() if not n.endswith(".so") or n == "vllm/_C_stable_libtorch.abi3.so"]
    z.extractall(target, keep)
PY
rm -rf "$target" && mv "$target.partial" "$target"
echo "$target"
