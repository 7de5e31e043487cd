#!/usr/bin/env bash
# One call on a machine with a GPU (the device tool's image has a CUDA torch and nvcc): builds the
# CUDA extension in place, runs the op tests on the GPU, runs compute-sanitizer (memcheck and
# racecheck) over the CUDA op tests, and prints the op benchmark table. Logs go to $OUT (or
# /tmp/gpu_check). pytest must be importable: carry its wheels if the image lacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"

echo "== build (FORCE_CUDA=1)"
FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py -q build_ext --inplace 2>&1 | tail -5
"$PY" -c "import cockpit_fast; assert cockpit_fast.has_cuda_kernels(); print('CUDA kernels registered')"

OP_TESTS="tests/test_square_norms.py tests/test_hist1d.py tests/test_hist2d.py tests/test_batch_dot.py tests/test_per_sample_stats.py tests/test_outer_hist1d.py tests/test_outer_hist2d.py tests/test_ops_contract.py"
echo "== op tests (CPU and CUDA)"
"$PY" -m pytest -q -ra $OP_TESTS 2>&1 | tee "$OUT/pytest.txt" | tail -15

SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool over the CUDA op tests"
  "$SANITIZER" --tool "$tool" --error-exitcode 99 \
    "$PY" -m pytest -q -x -k "cuda" -m "not large" $OP_TESTS 2>&1 | tee "$OUT/sanitizer_$tool.txt" | tail -6
done

echo "== op benchmark"
"$PY" benchmarks/bench_ops.py 2>&1 | tee "$OUT/bench_ops.txt"
