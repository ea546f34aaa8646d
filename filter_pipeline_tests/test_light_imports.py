"""What must load without Dagster (or aiohttp): the command line's entry and `verify`, the review app and the
LLM judge's client. A user's `filter-pipeline --help`, `verify` and `review` start fast, and gate-judged runs
never load the HTTP client."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # (a fresh interpreter per module)

LIGHT = ["filter_pipeline.cli.main", "filter_pipeline.rules.verify", "filter_pipeline.review.app",
         "filter_pipeline.judge.client"]  # fmt: skip


@pytest.mark.parametrize("module", LIGHT)
def test_loads_without_dagster_or_the_http_client(module):
    probe = f"import sys, {module}; print(sorted(m for m in ('dagster', 'aiohttp') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
