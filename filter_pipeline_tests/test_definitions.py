"""The wiring: settings from the environment reach the definitions, and bad ones are refused by name."""

import dagster as dg
import pytest

from filter_pipeline.definitions import EXECUTOR_ENV, build_defs, defs_from_env
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.warehouse import DATA_ENV, ENDPOINT_ENV


def test_an_unknown_executor_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="FILTER_PIPELINE_EXECUTOR='threads': expected one of in_process, multiprocess"):
        build_defs("data", JudgeResource(), caps={}, executor="threads")


def test_the_environment_chooses_data_root_endpoint_and_executor(monkeypatch):
    monkeypatch.setenv(DATA_ENV, "s3://bucket/prefix")
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:9")
    monkeypatch.setenv(EXECUTOR_ENV, "multiprocess")
    defs = defs_from_env()
    data = defs.resources["data"]
    assert (data.path, data.endpoint_url) == ("s3://bucket/prefix", "http://127.0.0.1:9")
    assert defs.resolve_job_def("judge_job").executor_def is dg.multiprocess_executor


def test_by_default_steps_run_in_the_runs_own_process(monkeypatch):
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    assert defs_from_env().resolve_job_def("ledger_job").executor_def is dg.in_process_executor
