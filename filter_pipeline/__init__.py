"""filter_pipeline: the filter stage of a synthetic web-agent training-data generator, as a Dagster code location.

- `rules/`: the pure rules (parsing a batch, the ledger walk, history, checks, reports): data in, data out; no
  files, threads, locks or Dagster.
- `storage/`: the data root: listing and reading runs, atomic writes, the ledger lease, commit records and
  their publish, history, labels, the audit.
- `judge/`: the judges (the deterministic gate, an LLM behind an OpenAI-compatible endpoint).
- `shell/`: the Dagster shell: assets, jobs, sensors, the warehouse IO manager, run config.
- `cli/`: `filter-pipeline` (materialize, verify, explain, calibrate, review).
- `review/`: the review app: every run's and task's fate, and labelling.
- `definitions.py` wires the shell into the code location Dagster loads.

`CONTRACT §n` in comments and docstrings names section n of docs/contract.md.
"""
