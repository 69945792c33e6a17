#!/usr/bin/env bash
# Build the images of compose.yaml on a machine that reaches no image registry and no PyTorch
# index, only PyPI and Debian's mirrors: every image FROM a local Debian base image (made
# with debootstrap and `docker import`, tagged local/debian:bookworm), torch from a local CPU
# wheel, pip through this machine's CA bundle. The defaults below are the development
# machine's paths; set the variables for yours. The tags are compose.yaml's defaults, so `docker compose` (or
# `docker-compose`) then runs these images without building.
#
#   ops/build-local.sh [gateway] [worker] [redis] [prometheus]   # default: all four
#
# Environment: BASE_IMAGE (local/debian:bookworm), TORCH_WHEEL (the CPU wheel for
# Python 3.11), CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt), PAGEDSERVE_GATEWAY_IMAGE,
# PAGEDSERVE_WORKER_CPU_IMAGE, PAGEDSERVE_LOCAL_REDIS_IMAGE, PAGEDSERVE_LOCAL_PROMETHEUS_IMAGE
# (the tags).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-local/debian:bookworm}
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
GATEWAY_TAG=${PAGEDSERVE_GATEWAY_IMAGE:-pagedserve-gateway:0.1.0}
WORKER_TAG=${PAGEDSERVE_WORKER_CPU_IMAGE:-pagedserve-worker:0.1.0-cpu}
REDIS_TAG=${PAGEDSERVE_LOCAL_REDIS_IMAGE:-local/redis:bookworm}
PROMETHEUS_TAG=${PAGEDSERVE_LOCAL_PROMETHEUS_IMAGE:-local/prometheus:bookworm}

targets=("$@")
((${#targets[@]})) || targets=(gateway worker redis prometheus)

# ops/local/ is git-ignored: only this machine's files go there, and only the build stages
# read them (the final images copy the virtual environment, not the wheel or the bundle).
cp "$CA_BUNDLE" ops/local/ca-certificates.crt
# The torch wheel goes in before any build: the gateway's build context holds ops/local/ too,
# and a wheel that arrived after its first build would undo its layer cache on the next one.
wheel=$(basename "$TORCH_WHEEL")
[[ -f ops/local/$wheel || ! -f $TORCH_WHEEL ]] || cp "$TORCH_WHEEL" "ops/local/$wheel"
timed_build() {  # tag, then docker build arguments
  local tag=$1 start=$SECONDS
  shift
  docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$tag" "$@" .
  echo "built $tag in $((SECONDS - start)) s: $(docker image inspect -f '{{.Size}}' "$tag") bytes"
}
for target in "${targets[@]}"; do
  case $target in
    gateway) timed_build "$GATEWAY_TAG" -f ops/gateway.Dockerfile ;;
    worker)
      [[ -f ops/local/$wheel ]] || { echo "no torch wheel at $TORCH_WHEEL (TORCH_WHEEL)" >&2; exit 2; }
      timed_build "$WORKER_TAG" -f ops/worker.Dockerfile \
        --build-arg TORCH_SPEC="/tmp/local/$wheel" --build-arg TORCH_INDEX_URL=https://pypi.org/simple ;;
    redis) timed_build "$REDIS_TAG" -f ops/redis.Dockerfile ;;
    prometheus) timed_build "$PROMETHEUS_TAG" -f ops/prometheus.Dockerfile ;;
    *) echo "unknown image $target (gateway, worker, redis, prometheus)" >&2; exit 2 ;;
  esac
done
