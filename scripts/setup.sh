#!/usr/bin/env bash
# Everything a fresh machine needs, idempotent: a venv in .venv with the CPU build of torch, the
# originals we test and benchmark against (Cockpit 1.0.2, BackPACK, gradient-metrics 0.5.0), the
# demo's dependencies, and cockpit_fast itself, built and installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}  # the CPU wheel on this machine's disk

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

echo "== installing dependencies into $VENV"
# Cockpit imports pkg_resources, which setuptools 81 removed.
pip_install --upgrade pip wheel "setuptools<81"
pip_install "$TORCH_SPEC" numpy ninja
# BackPACK pins torchvision, whose wheel would drag in a multi-GB CUDA torch; BackPACK's core
# never imports it, so the originals go in without their declared dependencies.
pip_install --no-deps backpack-for-pytorch==1.7.1 cockpit-for-pytorch==1.0.2 gradient-metrics==0.5.0
pip_install einops unfoldNd json_tricks pandas scipy seaborn matplotlib scikit-learn tqdm tensorboard pytest

echo "== building cockpit_fast (CPU kernels)"
FORCE_ONLY_CPU=1 MAX_JOBS=${MAX_JOBS:-2} pip_install --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import cockpit_fast; assert cockpit_fast.has_extension(), 'extension not built'; print('cockpit_fast', cockpit_fast.__version__, 'built')"
