# The two commands of the README. Each builds .venv from pyproject.toml on first use.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Three test processes, each file's tests in one of them: the stream tests mostly wait on
# group joins and timers, so a third process keeps both cores of a 2-core machine busy
# (-n 0 runs serially).
PYTEST_PARALLEL ?= -n 3 --dist loadfile

.PHONY: demo test bench evaluation

demo: $(STAMP)
	$(VENV)/bin/splu demo

test: $(STAMP)
	deploy/system-packages.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest $(PYTEST_PARALLEL) --durations=25

bench: $(STAMP)
	$(VENV)/bin/python bench/batch_decoy.py
	$(VENV)/bin/python bench/decoy_accuracy.py
	$(VENV)/bin/python bench/personal_accuracy.py
	$(VENV)/bin/python bench/query_latency.py

# docs/evaluation.md and docs/evaluation/ (CSVs, PNGs): every mechanism, fixed seeds.
evaluation: $(STAMP)
	$(VENV)/bin/python -m bench.experiments

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)
