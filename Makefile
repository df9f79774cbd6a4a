# geofed developer entry points. Every target creates or reuses the virtualenv in $(VENV).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.geofed-installed
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Each demo run gets a fresh work dir (PKI, state, logs, summary.json).
DEMO_DIR ?= run/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup system-deps bytecode demo test test-gpu lint typecheck pytest bench clean

# torch through pip (where a local file serves it), the rest through uv: 12 to 15 s where
# pip took 31 on a fresh clone. Bytecode compiled as pip does it: where PYTHONDONTWRITEBYTECODE
# is set, every process would compile what it imports again.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)' uv
	$(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -e '.[dev,postgres,hf]'
	touch $(STAMP)

setup: $(STAMP)

# mosquitto, promtool, chromium and a PostgreSQL server, which the integration tests run for real.
system-deps:
	scripts/install-system-deps.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Two workers, one per core of the machine CI runs on; a test module runs whole in one
# (its module-scoped worker groups and brokers are made once). Modules go out in collection
# order, the integration tier first: xdist's default order (most tests first) left the
# long federation modules, which hold one test or two, for the end, one worker running
# them while the other idled.
PYTEST_WORKERS ?= 2
PYTEST_RUN = $(VENV)/bin/pytest tests -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
pytest: $(STAMP) system-deps bytecode
	$(PYTEST_RUN)

# The project's own modules compiled to bytecode once (about a second). A run starts
# hundreds of Python processes (daemons, launchers, ranks); where PYTHONDONTWRITEBYTECODE
# is set (as where CI runs), none writes the bytecode it compiles, so each compiled the
# project again: 0.2 s of CPU a process, 11% of the CPU of a dozen federation tests.
# Python still checks each file's bytecode against its source: an edit is never stale.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 coordinator regional_agent geofed geofed_cli benchmarks tests >/dev/null

# mypy runs beside the tests at the lowest priority, on the CPU they leave idle (45 CPU
# seconds on a fresh clone, which it took first when it ran alone), and reports after them;
# `make typecheck` runs it alone. Either failing fails the target.
test: lint system-deps bytecode
	@nice -n 19 $(VENV)/bin/mypy > $(VENV)/mypy-report.txt 2>&1 & typecheck=$$!; \
	$(PYTEST_RUN); tests=$$?; \
	wait $$typecheck; typed=$$?; echo "mypy:"; cat $(VENV)/mypy-report.txt; \
	test $$tests -eq 0 && test $$typed -eq 0

# The GPU tests (tests/gpu/; `pytest tests` leaves them out): never part of `make test` or CI.
# Run on a CUDA machine with a Python whose torch sees the GPU (a GPU image's own python3,
# into which geofed is installed as docs/gpu.md says); each test fails without a GPU.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m pytest tests/gpu

# The main job: a coordinator and 3 regional agents on loopback training the example task.
demo: $(STAMP) bytecode
	$(VENV)/bin/geofed demo --workdir $(DEMO_DIR)

# Figures go to benchmarks/results/ (JSON and markdown); about 20 min on 2 quiet cores.
# The convergence H/warm-start sweep: $(PY) -m benchmarks.convergence --sweep
# Aggregation rules under one hostile region: $(PY) -m benchmarks.convergence --robust
# The outer optimizer's lr/momentum/warm-up sweep: $(PY) -m benchmarks.convergence --outer-sweep
# The tuned, seeded baseline with confidence intervals (~90 min): $(PY) -m benchmarks.baseline
# Delayed folds at lags of 1/4, 1/2 and 1 phase, four corrections (about 35 minutes): $(PY) -m benchmarks.staleness
# A region at half speed: wait for it, drop or merge its late deltas (about 8 minutes): $(PY) -m benchmarks.slow_region
bench: $(STAMP) system-deps
	$(PY) -m benchmarks.codec_bench
	$(PY) -m benchmarks.round_overhead
	$(PY) -m benchmarks.handoff
	$(PY) -m benchmarks.convergence
	$(PY) -m benchmarks.training_throughput
	$(PY) -m benchmarks.transfer
	$(PY) -m benchmarks.utilization
	$(PY) -m benchmarks.scheduling
	$(PY) -m benchmarks.scale

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
