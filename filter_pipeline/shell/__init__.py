"""The Dagster shell: assets, jobs, the batch sensor, the warehouse IO manager and run config. Each asset loads its
inputs, calls a rule from `filter_pipeline.rules`, attaches metadata and returns."""
