# Two commands do everything on a fresh machine with Python 3.11 and make:
#   make run    set up .venv and the local Dagster instance, then filter the sample batches in data/
#   make test   the whole test suite (CI runs it, after make lint and before make test-oldest)
# and for development:
#   make setup       only the set-up: .venv and the local Dagster instance (.dagster_home/)
#   make dev         `dagster dev` on the local instance (http://127.0.0.1:3000)
#   make review      the review app: every run's and task's fate, labelling (http://127.0.0.1:8765)
#   make test-fast   the tests that start no server or process (`-m "not slow"`): the quick loop
#   make lint        ruff check + ruff format --check + the package's shape (scripts/check_shape.py; CI runs it first)
#   make test-oldest the fast tests in .venv-oldest, on the oldest Dagster, pandas and pyarrow supported (constraints/dagster-1.12.txt)
#   make constraints rewrite constraints/py311.txt from a fresh install (after changing a dependency)
#   make sample-data write the sample batches in data/runs/ and data/labels.jsonl anew
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
# every install resolves to these exact versions (constraints/py311.txt, made by `make constraints`)
CONSTRAINTS := constraints/py311.txt
OLDEST := constraints/dagster-1.12.txt
DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export DAGSTER_HOME

.PHONY: setup run dev review test test-fast test-oldest lint constraints sample-data

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $@

$(DAGSTER_HOME)/dagster.yaml: instance/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp instance/dagster.yaml $@

# The package is installed editable, so pip never compiles it; where PYTHONDONTWRITEBYTECODE is set, every
# process would compile its modules again at start (compileall only rewrites files whose source changed).
setup: $(VENV)/.installed $(DAGSTER_HOME)/dagster.yaml
	@$(VENV)/bin/python -m compileall -q filter_pipeline

run: setup
	$(VENV)/bin/filter-pipeline materialize
	@echo
	@echo "Outputs: data/warehouse/<asset>/<run_id>.parquet"
	@echo "Open the UI:  make dev   then browse http://127.0.0.1:3000 (same instance, sensor on)"

dev: setup
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# the review app over the same data root (beside `make dev`): http://127.0.0.1:8765
review: setup
	$(VENV)/bin/filter-pipeline review

# pytest exits 5 when it collects no test: reported, not treated as a broken build.
test: setup
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$status

# The quick loop: the tests that start no server or process, over FAST_WORKERS processes (pytest-xdist).
# One more process than a 2-core machine has cores: many tests spend part of their time waiting (a judge test
# on its loopback endpoint's back-off, a test on an instance in a folder on its disk writes), and a third
# process runs meanwhile.
FAST_WORKERS ?= 3
FAST_TESTS = -q -p no:cacheprovider -m "not slow" -n $(FAST_WORKERS)

test-fast: setup
	$(VENV)/bin/python -m pytest $(FAST_TESTS) $(PYTEST_ARGS)

# py311.txt with the oldest release's lines in place of its own entries of those names (names compared as pip
# does: case and -_. ignored)
.venv-oldest/.installed: pyproject.toml $(CONSTRAINTS) $(OLDEST)
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install --quiet --upgrade pip
	awk 'function name(s) { s = tolower(s); sub(/[=<>!~ ;\[].*/, "", s); gsub(/[-_.]+/, "-", s); return s } \
	     NR == FNR { if ($$0 !~ /^#/ && NF) { oldest[name($$0)] = 1; print }; next } \
	     !(name($$0) in oldest)' $(OLDEST) $(CONSTRAINTS) > .venv-oldest/constraints.txt
	.venv-oldest/bin/python -m pip install --quiet -c .venv-oldest/constraints.txt -e '.[test]'
	touch $@

test-oldest: .venv-oldest/.installed $(DAGSTER_HOME)/dagster.yaml
	.venv-oldest/bin/python -c 'import dagster; print("dagster", dagster.__version__)'
	.venv-oldest/bin/python -m pytest $(FAST_TESTS) $(PYTEST_ARGS)

# the shape: rules/ pure, no function over 60 lines, no `global`, no module over 500 lines, pyproject.toml's
# dependencies the ones the package imports (scripts/check_shape.py)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python scripts/check_shape.py

# A throwaway venv with the newest releases pyproject.toml allows, every extra the image installs included;
# its freeze (minus this package) is the file.
constraints:
	rm -rf .venv-freeze
	$(PYTHON) -m venv .venv-freeze
	.venv-freeze/bin/python -m pip install --quiet --upgrade pip
	.venv-freeze/bin/python -m pip install --quiet -e '.[test,k8s]'
	{ echo "# pip freeze of a fresh install of '.[test,k8s]' (make constraints); make setup and deploy/Dockerfile install with -c this file"; \
	  .venv-freeze/bin/python -m pip freeze --exclude-editable | grep -v '^filter.pipeline'; } > $(CONSTRAINTS)
	rm -rf .venv-freeze

sample-data: setup
	$(VENV)/bin/python scripts/make_sample_data.py
