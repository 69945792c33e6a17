#!/usr/bin/env bash
# Prepares what benchmarks/gpu_all.sh needs on a GPU machine that has torch, triton and
# transformers but not this project's other dependencies and no network:
#   .whl/  wheels of the rest for CPython 3.12 on manylinux x86-64 (gpu_all.sh installs them
#          into /tmp/site);
#   .gpu/  this machine's redis-server with the libraries it links (.gpu/redis-server.sh runs
#          it), for the `serve` step.
# Both are git-ignored locally (.git/info/exclude) and travel as carried paths (about 30 MB).
#
#   bash benchmarks/gpu_carry.sh [PYTHON_VERSION]     # default 3.12, the GPU image's
set -eu
cd "$(dirname "$0")/.."
py=${1:-3.12}
for path in /.whl/ /.gpu/; do grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
mkdir -p .whl .gpu/lib
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${platforms[@]}" -d .whl \
    msgspec redis litestar uvicorn opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
    opentelemetry-exporter-otlp-proto-http "llguidance>=1.0,<2"
server=$(command -v redis-server) || { echo "no redis-server here: the serve step needs one"; exit 1; }
cp "$server" .gpu/redis-server
# every library it links but the C runtime's own (the GPU image has those)
ldd "$server" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux)[.-]' \
    | while read -r lib; do cp -L "$lib" .gpu/lib/; done
cat > .gpu/redis-server.sh <<'EOF'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib" exec "$here/redis-server" "$@"
EOF
chmod +x .gpu/redis-server.sh
.gpu/redis-server.sh --version
du -sh .whl .gpu
echo 'then: run(command="bash benchmarks/gpu_all.sh", carry=[".whl", ".gpu"])'
