"""filter_pipeline: the filter stage of a synthetic web-agent training-data generator, as a Dagster code location.

- `rules/`: the pure rules (parsing a batch, the ledger walk, history, checks, reports): plain Python and pandas,
  no Dagster.
- `judge/`: the judges (the deterministic gate, an LLM behind an OpenAI-compatible endpoint).
- `shell/`: the Dagster shell: assets, jobs, the sensor, the warehouse IO manager, run config.
- `cli/`: `filter-pipeline materialize` and `filter-pipeline verify`.
- `definitions.py` wires the shell into the code location Dagster loads.

`CONTRACT §n` in comments and docstrings names section n of docs/contract.md.
"""
