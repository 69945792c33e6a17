#!/usr/bin/env bash
# A Docker engine and the compose stack's images on this machine, for the `docker` tests
# (tests/ops/test_stack.py and the containerized Redis of tests/gateway/test_app.py) on a
# machine that reaches no image registry, only Debian's mirrors and PyPI. Idempotent: once
# everything is there, a run takes seconds (Docker's layer cache rebuilds nothing).
#
#   ops/docker-engine.sh [--images] [--background]
#
#   1. installs Debian's docker.io, docker-compose (v1, reads compose.yaml) and debootstrap
#      if missing (needs root and apt-get; where an engine answers, it goes on without them);
#   2. starts dockerd in the background (log: /tmp/dockerd.log) unless `docker info` answers;
#   3. builds the base image local/debian:bookworm with debootstrap, unless it exists (without
#      debootstrap, none: the tests then build the images from a registry's);
#   4. with --images: ops/build-local.sh builds the gateway, CPU worker, Redis and
#      Prometheus images on that base.
#
# --background: returns at once; the run goes on detached, its output in
# $PAGEDSERVE_DOCKER_ENGINE_LOG (default .cache/docker-engine.log). `make test` starts it so
# while the checks and the other tests run; `make test-docker` then runs this script again,
# which waits for the background run (one run at a time, a lock) and reports its outcome.
#
# Outcome, the last line: "docker engine ready: ..." (exit 0); "docker engine unavailable:
# REASON" (exit 1: no engine could be started here, e.g. not root, no apt-get, dockerd does
# not start; the `docker` tests then skip with that reason, which tests/conftest.py reads from
# $PAGEDSERVE_DOCKER_ENGINE_STATUS, default .cache/docker-engine.status); "docker images not
# built: ..." (exit 2: the engine runs, the base image or a build failed; the tests build
# again and fail with the build's error).
#
# Testcontainers (tests/gateway/test_app.py) also needs TESTCONTAINERS_RYUK_DISABLED=true
# here, since its reaper image cannot be pulled; the test sets it where the local base exists.
set -uo pipefail

# the whole script is read before it runs (a checkout that changes it mid-run changes nothing)
{
  cd "$(dirname "$0")/.."

  BASE_IMAGE=${BASE_IMAGE:-local/debian:bookworm}
  LOG=${PAGEDSERVE_DOCKER_ENGINE_LOG:-.cache/docker-engine.log}
  STATUS=${PAGEDSERVE_DOCKER_ENGINE_STATUS:-.cache/docker-engine.status}
  LOCK=${PAGEDSERVE_DOCKER_ENGINE_LOCK:-/tmp/pagedserve-docker-engine.lock}

  images=false
  background=false
  for arg in "$@"; do
    case $arg in
      --images) images=true ;;
      --background) background=true ;;
      *) echo "usage: $0 [--images] [--background]" >&2; exit 2 ;;
    esac
  done

  mkdir -p "$(dirname "$LOG")" "$(dirname "$STATUS")"
  if $background; then
    rm -f "$STATUS"
    args=()
    $images && args+=(--images)
    # detached (its own session), so the caller's terminal and make do not wait for it
    setsid nohup ops/docker-engine.sh "${args[@]}" >"$LOG" 2>&1 </dev/null &
    echo "docker engine: starting in the background (log: $LOG)"
    exit 0
  fi

  # the outcome: the last line, also written to $STATUS (tests/conftest.py reads a failure there)
  finish() { echo "$2"; echo "$2" >"$STATUS"; exit "$1"; }
  unavailable() { finish 1 "docker engine unavailable: $*"; }
  not_built() { finish 2 "docker images not built: $*"; }
  stage_start=$SECONDS
  stage() { echo "  $1: $((SECONDS - stage_start)) s"; stage_start=$SECONDS; }

  # One run at a time: apt-get, dockerd and the image tags are the machine's. A run that had
  # to wait for another (the background one) reports that one's failure instead of repeating it.
  if command -v flock >/dev/null; then
    exec 9>>"$LOCK"
    if ! flock -n 9; then
      echo "docker engine: waiting for the run in progress (log: $LOG)"
      wait_start=$SECONDS
      flock 9
      echo "  waited: $((SECONDS - wait_start)) s"
      outcome=$(cat "$STATUS" 2>/dev/null)
      if [[ -n $outcome ]] && { ! $images || [[ $outcome != "docker engine ready:"* ]] || [[ $outcome == *"images built"* ]]; }; then
        [[ -f $LOG ]] && sed 's/^/  | /' "$LOG"
        case $outcome in
          "docker engine ready:"*) finish 0 "$outcome" ;;
          "docker engine unavailable:"*) finish 1 "$outcome" ;;
          *) finish 2 "$outcome" ;;
        esac
      fi
    fi
  fi
  rm -f "$STATUS"

  root=false
  [[ $(id -u) == 0 ]] && root=true
  engine_answers() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }
  docker_error() { docker info 2>&1 >/dev/null | grep -v '^$' | tail -n 1; }

  # 1. packages: dockerd unless an engine already answers, docker-compose unless compose v2
  #    is there, debootstrap (for the base image). Where an engine answers and they cannot be
  #    installed, the run goes on without them (a machine with Docker and a registry).
  need=()
  if ! engine_answers; then
    command -v dockerd >/dev/null || need+=(docker.io)
  fi
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || need+=(docker-compose)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  cannot_install=""
  if ! $root; then
    cannot_install="only root can install them (apt-get)"
  elif ! command -v apt-get >/dev/null; then
    cannot_install="there is no apt-get to install them"
  fi
  if ((${#need[@]})) && [[ -n $cannot_install ]]; then
    engine_answers || unavailable "${need[*]} missing, and $cannot_install"
    echo "missing: ${need[*]} ($cannot_install)"
  elif ((${#need[@]})); then
    echo "installing ${need[*]} (Debian's packages)"
    # waiting for another apt-get or dpkg (up to 5 minutes) rather than failing at once
    apt-get -o DPkg::Lock::Timeout=300 update -qq >/tmp/docker-engine-apt.log 2>&1 \
      && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${need[@]}" >>/tmp/docker-engine-apt.log 2>&1 \
      || unavailable "apt-get install ${need[*]} failed: $(tail -n 1 /tmp/docker-engine-apt.log)"
    stage packages
  fi

  # 2. the engine
  if ! engine_answers; then
    $root || unavailable "no engine answers ($(docker_error)), and only root can start dockerd"
    echo "starting dockerd (log: /tmp/dockerd.log)"
    nohup dockerd >/tmp/dockerd.log 2>&1 </dev/null 9>&- &  # not holding the lock
    for _ in $(seq 60); do engine_answers && break; sleep 1; done
    engine_answers || unavailable "dockerd did not answer within 60 s: $(tail -n 1 /tmp/dockerd.log)"
    stage dockerd
  fi

  # 3. the base image, from Debian's mirror (no image registry needed). Without debootstrap,
  #    none: the tests build the images from the registry's (tests/ops/stack.py).
  if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    [[ $BASE_IMAGE == local/debian:bookworm ]] || not_built "the base image $BASE_IMAGE does not exist"
    if ! command -v debootstrap >/dev/null; then
      finish 0 "docker engine ready: $(docker version --format '{{.Server.Version}}'); no base image $BASE_IMAGE (no debootstrap): the images come from a registry"
    fi
    echo "building $BASE_IMAGE with debootstrap (log: /tmp/debootstrap.log)"
    rootfs=$(mktemp -d)
    if ! debootstrap --variant=minbase bookworm "$rootfs" >/tmp/debootstrap.log 2>&1; then
      rm -rf "$rootfs"
      not_built "debootstrap of $BASE_IMAGE failed: $(tail -n 1 /tmp/debootstrap.log)"
    fi
    tar -C "$rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null || not_built "docker import of $BASE_IMAGE failed"
    rm -rf "$rootfs"
    stage "base image"
  fi

  # 4. the stack's images
  if $images; then
    echo "building the images (ops/build-local.sh; log: /tmp/docker-engine-build.log)"
    if ! BASE_IMAGE=$BASE_IMAGE ops/build-local.sh >/tmp/docker-engine-build.log 2>&1; then
      tail -n 20 /tmp/docker-engine-build.log
      not_built "ops/build-local.sh failed (log: /tmp/docker-engine-build.log)"
    fi
    grep '^built ' /tmp/docker-engine-build.log | sed 's/^/  /'
    stage images
  fi
  finish 0 "docker engine ready: $(docker version --format '{{.Server.Version}}'); base image $BASE_IMAGE$($images && echo '; images built')"
}
