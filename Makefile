# Each of these sets everything up on a fresh machine first:
#   make serve   – create the virtual environment if missing, then run `pagedserve serve`
#   make test    – create the virtual environment if missing, then run the test suite (and
#                  `make test-docker`: the container tests, where a Docker engine can start)
#   make check   – ruff, lint-imports (the layers) and mypy
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-docker check lint bench venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Without a GPU, take the CPU build of torch first; the range in pyproject.toml keeps it.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet torch==2.13.0; fi
	$(PY) -m pip install --quiet -e '.[dev,pull,plot]'
	# pagedserve starts its own redis-server (pagedserve/common/redis_server.py); fetch one if missing.
	command -v redis-server >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1; } || \
		echo "warning: no redis-server on PATH; install Redis or set PAGEDSERVE_REDIS_SERVER"
	# The console's browser tests (marker `browser`) drive Debian's chromium; without it they skip.
	test -x /usr/bin/chromium || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
		echo "warning: no /usr/bin/chromium; the browser tests will skip"
	# the Sentinel failover tests (tests/common/test_redis_sentinel.py) run redis-sentinel
	# (else `redis-server --sentinel`)
	command -v redis-sentinel >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && apt-get install -y -qq redis-sentinel) >/dev/null 2>&1; } || \
		echo "warning: no redis-sentinel on PATH; the Sentinel tests use redis-server --sentinel"
	touch $(STAMP)

# The OpenAI server on the defaults: its own Redis, the default model, CPU without a GPU.
serve: $(STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

# pytest-xdist worker processes for the non-docker tests (each whole file on one worker, so a
# module's fixtures are built once; tests/conftest.py gives each worker its share of torch's
# threads). 2, the default, for CI's two cores: much of the suite waits on servers, Redis and
# process start-ups, which two processes overlap. `make test TEST_WORKERS=0`: one process.
TEST_WORKERS ?= 2

# ruff, the layer contract ([tool.importlinter] in pyproject.toml), mypy ([tool.mypy]), pytest
# but the `docker` tests, then those (test-docker; they run whether or not the rest passed).
# The Docker engine and the images start in the background first (ops/docker-engine.sh),
# while the rest runs.
test: $(STAMP)
	ops/docker-engine.sh --background --images
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --durations=20 -m 'not docker' -n $(TEST_WORKERS) --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; \
	$(MAKE) --no-print-directory test-docker || rc=1; exit $$rc

# The container tests (the `docker` marker: tests/ops/test_stack.py, the containerized Redis
# of tests/gateway/test_app.py). ops/docker-engine.sh starts a Docker engine and builds the
# images, or waits for the run `make test` started; where no engine can start (not root, no
# apt-get), it says why and the tests skip with that reason. Only the files that spell
# `mark.docker` are collected (the whole tree takes minutes to import on 2 busy cores).
DOCKER_TEST_FILES = $(shell grep -rl --include='*.py' 'mark\.docker' tests)
test-docker: $(STAMP)
	ops/docker-engine.sh --images || true
	$(PY) -m pytest -q -m docker $(DOCKER_TEST_FILES); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The static checks alone (the first half of `test`).
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/pagedserve bench offline --workload fixed --dtype float32 --compare transformers
