#!/usr/bin/env bash
# Compiles the CUDA build (nvcc, FORCE_CUDA=1) against the CUDA build of torch, in a copy of the
# tree so that the CPU build in place stays untouched, then imports it (no GPU needed for that)
# and checks that every op has a CUDA kernel registered. CUDA code that does not compile fails here.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${CUDA_VENV:-.venv-cuda}
TORCH_SPEC=${CUDA_TORCH_SPEC:-torch==2.14.1}  # a CUDA 13.0 build, on this machine's disk
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "build_cuda.sh: no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$(cd "$VENV" && pwd)/bin/python"
"$PY" -m pip install --disable-pip-version-check -q --upgrade pip wheel "setuptools<81"
"$PY" -m pip install --disable-pip-version-check --no-cache-dir -q "$TORCH_SPEC" numpy ninja

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r setup.py csrc cockpit_fast "$work/"
rm -f "$work"/cockpit_fast/_C*.so
echo "== compiling the CUDA build with $("$CUDA_HOME/bin/nvcc" --version | tail -1)"
(cd "$work" && FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --inplace)
(cd "$work" && "$PY" - <<'PY'
import torch, cockpit_fast
assert cockpit_fast.has_extension() and cockpit_fast.has_cuda_kernels(), "CUDA kernels missing"
ops = ["batch_l2", "sum_grad_squared", "batch_l2_and_sum_grad_squared", "hist1d", "hist2d", "batch_dot",
       "per_sample_stats", "outer_hist1d", "outer_hist2d", "hist1d_batch_l2_batch_dots",
       "factored_hist1d_batch_l2_batch_dots"]
for op in ops:
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cockpit_fast::{op}", "CUDA"), op
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cockpit_fast::{op}", "CPU"), op
print("CUDA build OK: every op has CPU and CUDA kernels (torch", torch.__version__, ")")
PY
)
