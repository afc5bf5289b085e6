# The two set-up commands of the README: `make train` (the default CPU pretraining run) and
# `make test` (the whole test suite). Both create .venv first when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
# One OpenMP thread per process: tests run two workers (and two-rank process groups) on 2 cores.
TEST_ENV := OMP_NUM_THREADS=1 WANDB_MODE=offline WANDB_SILENT=true

.PHONY: venv browser slurm train test test-quick lint

venv: $(VENV)/.installed

# torch==2.13.0 first and explicitly: it is the CPU wheel on disk; an open range would pull CUDA.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# --resume auto: the first time it starts the run, later it continues it or says it is finished (exit 0).
train: venv
	$(PY) -m lightning_train fit --config configs/pretrain-tiny.yaml --resume auto

# tests/test_report.py opens report.html in headless Chromium: install it from the OS packages when it
# is missing and this runs as root (a fresh CI machine); elsewhere that test skips and says why.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  command -v google-chrome >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "make browser: no Chromium and no way to install it here (needs root and apt-get)"

# tests/test_slurm.py submits scripts/slurm-requeue.sbatch to a one-node SLURM cluster it starts itself
# (munged, slurmctld, slurmd): install them from the OS packages when missing and this runs as root (a
# fresh CI machine); elsewhere those tests skip and say why. The daemons live in /usr/sbin.
slurm:
	@PATH="$$PATH:/usr/sbin:/sbin"; \
	  { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	      slurmctld slurmd slurm-client munge; } || \
	  echo "make slurm: no SLURM and no way to install it here (needs root and apt-get)"

test: venv browser slurm
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist worksteal --durations=15 -q

test-quick: venv browser slurm
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist worksteal -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check .
