#!/usr/bin/env bash
# The GPU proof, in stages that each fit one call of the device tool (10 minutes):
#   bash benchmarks/gpu_check.sh STAGE...
# setup      installs the carried wheels (.whl/: BackPACK, Cockpit, gradient-metrics and their pure-Python
#            needs, absent from the image) into /tmp/site, and builds the CUDA extension in place unless a
#            carried one imports (sm_90 only unless TORCH_CUDA_ARCH_LIST says otherwise; about 90 s on 16
#            cores; the library is too large to come back through $OUT, so every call builds it)
# cudatests  every test whose id names the CUDA device (each op in every dtype, layout and shape against
#            its float64 reference; CPU/CUDA agreement; tracked steps with no host synchronisation)
# large      the past-2^31-element test, on the CPU and the GPU
# sanitize   compute-sanitizer memcheck, racecheck and synccheck over a slice of the CUDA op tests
# suite      the whole test suite on this machine (CUDA visible), spread over the cores
# bench      the op benchmark on CUDA beside Cockpit's pure-torch path (bench_ops.py --device cuda)
# step       tracked steps against plain ones on CUDA: the CNN and GPT-2 (124M, T=1024), economy and
#            GradHist2d, then GPT-2 under bf16 autocast (bench_step.py --device cuda)
# streaming  GPT-2 (124M) under bf16 autocast, then in float32: statistics as each gradient arrives
#            against the same step with them computed after the backward pass (bench_streaming.py)
# profile    where the CUDA step's time goes (profile_step.py): the CNN plain and under economy, GPT-2
#            (124M) under economy in float32 and under bf16 autocast
# Logs go to $OUT (or /tmp/gpu_check); each stage has a time limit (seconds) in LIMIT_<stage>.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
failed=0
run() {  # run NAME LIMIT COMMAND...: logs to $OUT/NAME.txt, the end shown, failure remembered
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n "${TAIL:-12}" "$OUT/$name.txt"
  echo "== $name: exit $rc"
  [ $rc -eq 0 ] || failed=1
}
OP_TESTS=$(ls tests/test_{square_norms,hist1d,hist2d,batch_dot,per_sample_stats,outer_hist1d,outer_hist2d,hist1d_batch_l2_batch_dots,factored_hist1d_batch_l2_batch_dots,ops_contract}.py)

for stage in "$@"; do
  case $stage in
    setup)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
      if ls .whl/*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --ignore-requires-python --target /tmp/site .whl/*.whl
      fi
      "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$OUT/device.txt"
      if ! "$PY" -c "import cockpit_fast, sys; sys.exit(not cockpit_fast.has_cuda_kernels())" 2> /dev/null; then
        rm -f cockpit_fast/_C*.so
        TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} run build 480 env FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py build_ext --inplace
      fi
      "$PY" -c "import cockpit_fast; assert cockpit_fast.has_cuda_kernels(); print('CUDA kernels registered')" || exit 1
      ;;
    cudatests) run cudatests "${LIMIT_cudatests:-300}" "$PY" -m pytest -q -ra -n 8 -p no:cacheprovider -k cuda tests ;;
    large) run large "${LIMIT_large:-200}" "$PY" -m pytest -q -ra -p no:cacheprovider -m large tests ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        run "sanitizer_$tool" "${LIMIT_sanitize:-120}" "${SANITIZER:-$CUDA_HOME/bin/compute-sanitizer}" --tool "$tool" --error-exitcode 99 \
          "$PY" -m pytest -q -p no:cacheprovider -k "cuda and offset and (dtype0 or dtype2)" -m "not large" $OP_TESTS
      done
      ;;
    suite) run suite "${LIMIT_suite:-420}" "$PY" -m pytest -q -ra -n 14 -p no:cacheprovider tests --deselect tests/test_install.py ;;
    bench) run bench_ops "${LIMIT_bench:-240}" "$PY" benchmarks/bench_ops.py --device cuda ;;
    step)
      TAIL=8 run bench_step "${LIMIT_step:-240}" "$PY" benchmarks/bench_step.py --device cuda \
        --model cnn --model gpt2 --gpt2-size 124m --only economy GradHist2d
      TAIL=6 run bench_step_bf16 "${LIMIT_step:-240}" "$PY" benchmarks/bench_step.py --device cuda --bf16 \
        --model gpt2 --gpt2-size 124m --only economy GradHist2d
      ;;
    streaming)
      for precision in --bf16 ""; do
        TAIL=5 run "bench_streaming${precision:+_bf16}" "${LIMIT_streaming:-200}" "$PY" benchmarks/bench_streaming.py \
          --device cuda --model gpt2 --gpt2-size 124m $precision
      done
      ;;
    profile)
      for problem in "cnn plain" "cnn economy" "gpt2 economy" "gpt2 economy --bf16"; do
        read -r model case extra <<< "$problem"
        TAIL=80 run "profile_${model}_${case}${extra:+_bf16}" "${LIMIT_profile:-90}" "$PY" benchmarks/profile_step.py \
          --device cuda --gpt2-size 124m --model "$model" --case "$case" $extra --rows 25
      done
      ;;
    *) echo "gpu_check.sh: unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $failed
