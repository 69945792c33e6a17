#!/usr/bin/env bash
# `pagedserve serve` with one worker on the GPU and a random-weight Llama-3.2-1B-shaped model
# (the tests' byte-level tokenizer, so a 320-token vocabulary), then the `serve` workload of
# `pagedserve bench serve` against it: every request must complete. Prints TTFT and TPOT;
# writes bench serve's JSON to $1. Run by benchmarks/gpu_all.sh (step `serve`).
# GPU_SERVE_SMOKE=1: a tiny model and 8 requests, to check the script on a CPU.
set -u
cd "$(dirname "$0")/.."
json=${1:-/tmp/serve.json}
dir=$(mktemp -d)
python3 - "$dir/model" <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
from pathlib import Path
from gpu_checks import LLAMA32_1B
from gpu_e2e import TINY, _model_dir
import os
shape = TINY if os.environ.get("GPU_SERVE_SMOKE") else LLAMA32_1B
print("model:", _model_dir({**shape, "vocab_size": 320, "max_position_embeddings": 4096}, Path(sys.argv[1])))
EOF
port=${GPU_SERVE_PORT:-18431}
if curl -s "http://127.0.0.1:$port/health" >/dev/null; then echo "port $port is taken: another server runs"; exit 1; fi
cli=(python3 -c "import sys; from pagedserve.entrypoints.cli import main; sys.exit(main())")  # no console script needed
# its own process group (setsid), so that the launcher, its worker and its redis-server all
# get the signals below
setsid "${cli[@]}" serve --model "$dir/model/llama-shaped" --load-format dummy --num-workers 1 --port $port \
    --max-model-len 4096 > "$dir/serve.log" 2>&1 &
server=$!
stop() {
    kill -INT -- -$server 2>/dev/null  # the launcher drains and stops its worker
    for _ in $(seq 1 40); do kill -0 $server 2>/dev/null || break; sleep 1; done
    kill -9 -- -$server 2>/dev/null
    tail -n 30 "$dir/serve.log"
}
trap stop EXIT
for _ in $(seq 1 "${GPU_SERVE_WAIT:-120}"); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "serve exited"; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$port/ready" || { echo "serve not ready in time"; exit 1; }
echo
set -o pipefail
"${cli[@]}" bench serve --base-url "http://127.0.0.1:$port" --workload serve --vocab-size 320 --no-progress --json \
    ${GPU_SERVE_SMOKE:+--num-requests 8} | tee "$dir/bench.out"
status=$?
tail -n 1 "$dir/bench.out" > "$json"
exit $status
