"""`python -m filter_pipeline.cli`: the same as the `filter-pipeline` command."""

from filter_pipeline.cli.main import run

run()
