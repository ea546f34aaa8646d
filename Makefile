# Two commands do everything on a fresh machine with Python 3.11 and make:
#   make run    set up .venv and the local Dagster instance, then filter the sample batches in data/
#   make test   the whole test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export DAGSTER_HOME

.PHONY: setup run dev test sample-data

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $@

$(DAGSTER_HOME)/dagster.yaml: instance/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp instance/dagster.yaml $@

setup: $(VENV)/.installed $(DAGSTER_HOME)/dagster.yaml

run: setup
	$(VENV)/bin/filter-pipeline materialize
	@echo
	@echo "Outputs: data/warehouse/<asset>/<run_id>.parquet"
	@echo "Open the UI:  make dev   then browse http://127.0.0.1:3000 (same instance, sensor on)"

dev: setup
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# pytest exits 5 when it collects no test: reported, not treated as a broken build.
test: setup
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$status

sample-data: setup
	$(VENV)/bin/python scripts/make_sample_data.py
