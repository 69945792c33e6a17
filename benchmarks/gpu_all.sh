#!/usr/bin/env bash
# Every GPU check and figure of issue #36 in one run, in the order they matter, each step
# under its own time limit and all of them under one deadline, so that a step that hangs or
# fails still leaves the others' figures. Writes $OUT/gpu_all.log (everything) and the
# scripts' JSON files ($OUT/e2e.json, $OUT/checks.json, $OUT/serve.json).
#
#   bash benchmarks/gpu_all.sh                         # every step
#   bash benchmarks/gpu_all.sh kernels e2e twins       # some of them, in this order
#   GPU_DEADLINE_S=300 bash benchmarks/gpu_all.sh      # stop starting steps past 300 s
#
# Steps: kernels (benchmarks/gpu_kernels.py), gemm (its GEMM cases only), w4a16 (its w4a16
# cases only, group 128; w4a16-g32: group 32), calibration (gpu_checks.py's int4 calibration),
# e2e (benchmarks/gpu_e2e.py),
# twins (the `gpu` tests of the Triton int8 / int4 / quantized-KV files: each file's tests
# compiled on the GPU; twin-int4: the int4 file's only), checks (benchmarks/gpu_checks.py),
# quant (its int8 and int4 variants only), serve (`pagedserve serve` with one worker and a
# random-weight model, then `pagedserve bench serve`).
#
# A machine without this project's dependencies: put wheels in .whl/ (installed into
# /tmp/site) and, for `serve`, a redis-server in .gpu/ (.gpu/redis-server.sh).
# benchmarks/gpu_carry.sh makes both here; carry them (".whl", ".gpu") to the GPU.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_all}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_all.log") 2>&1
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=${GPU_DEADLINE_S:-540}
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(kernels e2e twins checks serve)

elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "=== [$(elapsed) s] $*"; }

# run NAME LIMIT CMD...: at most LIMIT seconds, and never past the deadline
run() {
    local name=$1 limit=$2; shift 2
    local left=$(( DEADLINE - $(elapsed) ))
    if [ "$left" -lt 20 ]; then note "$name: skipped, ${left} s to the deadline"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    note "$name: start (limit ${limit} s)"
    local t0; t0=$(date +%s)
    timeout -k 10 "$limit" "$@"
    local status=$?
    note "$name: exit status $status after $(( $(date +%s) - t0 )) s"
    [ "$status" -eq 0 ] || FAILED+=("$name")
}
FAILED=()

if [ -d .whl ] && ! python3 -c "import msgspec, litestar" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# entry points (model, scheduler and sampler plugins) need the package's metadata
if ! python3 -c "import importlib.metadata as m; m.version('pagedserve')" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site-ps . \
        && export PYTHONPATH=$PWD:/tmp/site-ps:${PYTHONPATH:-} PATH=/tmp/site-ps/bin:$PATH
fi
[ -x .gpu/redis-server.sh ] && export PAGEDSERVE_REDIS_SERVER=$PWD/.gpu/redis-server.sh
unset TRITON_INTERPRET
note "setup done"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"

for step in "${STEPS[@]}"; do
    case $step in
    kernels) run kernels 120 python3 benchmarks/gpu_kernels.py ;;
    gemm) run gemm 120 python3 benchmarks/gpu_kernels.py --only gemm ;;
    w4a16) run w4a16 200 python3 benchmarks/gpu_kernels.py --only w4a16 ;;
    w4a16-g32) run w4a16-g32 200 python3 benchmarks/gpu_kernels.py --only w4a16 --groups 32 ;;
    calibration) run calibration 90 python3 benchmarks/gpu_checks.py --only calibration ;;
    quant) run quant 240 python3 benchmarks/gpu_checks.py --only quantization --json "$OUT/quant.json" \
        --variants "int8,int4,int4 g128" ;;
    e2e) run e2e 240 python3 benchmarks/gpu_e2e.py --json "$OUT/e2e.json" ;;
    twins) run twins 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 3 tests/kernels/test_triton_int8.py \
        tests/kernels/test_triton_int4.py tests/kernels/test_triton_quant_kv.py ;;
    twin-int4) run twin-int4 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_triton_int4.py ;;
    checks) run checks 200 python3 benchmarks/gpu_checks.py --json "$OUT/checks.json" ;;
    serve) run serve 150 bash benchmarks/gpu_serve.sh "$OUT/serve.json" ;;
    *) note "unknown step $step" ;;
    esac
done
if [ ${#FAILED[@]} -eq 0 ]; then note "done: every step passed"; else note "done: failed: ${FAILED[*]}"; exit 1; fi
