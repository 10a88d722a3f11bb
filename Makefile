# gpupool: `make run` starts the whole stack on embedded defaults; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
STAMP := $(VENV)/.gpupool-installed

.PHONY: run test lint fmt venv system-deps docker-up slurm-up migrate seed clean

$(STAMP): pyproject.toml client/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' -e ./client
	@touch $(STAMP)

venv: $(STAMP)

# Debian packages the test suite needs (a headless browser for the UI tests). Installed when
# missing and we are root with apt; otherwise the suite says which package is missing.
system-deps:
	@scripts/install-system-deps

# The Docker Engine and the local busybox image of the docker runtime's tests. When it cannot (not
# root, no docker), it says why and those tests skip with that reason (CI makes them fail instead).
docker-up: system-deps
	-@scripts/docker-up

# The single-host Slurm cluster of the Slurm region's tests (munged, slurmdbd on the local MariaDB,
# slurmctld, two slurmds on this host with GRES gpus), under /var/lib/gpupool-slurm. When it
# cannot, it says why and those tests skip with that reason (CI makes them fail instead).
slurm-up: system-deps
	-@scripts/slurm-up

migrate: venv
	DEBUG=1 $(BIN)/python manage.py migrate --noinput

seed: migrate
	DEBUG=1 $(BIN)/python manage.py seed_demo

run: seed
	@echo ""
	@echo "  gpupool is starting on http://127.0.0.1:$(PORT)/  (Ctrl-C stops everything)"
	@echo ""
	DEBUG=1 GPUPOOL_PORT=$(PORT) GPUPOOL_PYTHON=$(BIN)/python exec $(BIN)/honcho -f Procfile start

test: venv system-deps docker-up slurm-up
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	DEBUG=1 $(BIN)/python manage.py makemigrations --check --dry-run

fmt: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf var/gpupool.sqlite3* var/broker var/celerybeat-schedule* var/agents
