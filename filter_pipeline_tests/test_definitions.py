"""The wiring: settings from the environment reach the definitions, and bad ones are refused by name; the UI
explains every asset, column, check, job, sensor, resource field and config field."""

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import dagster as dg
import pytest
import yaml

from filter_pipeline.definitions import EXECUTOR_ENV, build_defs, defs_from_env
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.warehouse import DATA_ENV, ENDPOINT_ENV
from filter_pipeline_tests.conftest import REPO

LOCATION = "filter_pipeline"


def test_an_unknown_executor_name_is_refused_with_the_choices():
    with pytest.raises(
        ValueError, match="FILTER_PIPELINE_EXECUTOR='threads': expected one of in_process, multiprocess"
    ):
        build_defs("data", JudgeResource(), caps={}, executor="threads")


def test_bad_deployment_caps_fail_the_code_location_naming_the_variable(monkeypatch, tmp_path):
    caps = tmp_path / "caps.yaml"
    caps.write_text("caps:\n  buy: {tagret: 10}\n")
    monkeypatch.setenv("FILTER_PIPELINE_CAPS", str(caps))
    with pytest.raises(ValueError) as refused:  # (what the UI shows as the code location's load error)
        defs_from_env()
    assert str(refused.value) == f"FILTER_PIPELINE_CAPS: caps file {caps}: caps.buy has unknown key(s) tagret"


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


# --- what the UI shows: a description on everything a user can click -----------------------------------


def _package_subclasses(base: type) -> list[type]:
    """Every subclass of `base` defined in this package, at any depth (each class once)."""
    found, todo = {}, list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("filter_pipeline."):
            found[cls] = None
    return list(found)


def test_every_asset_and_asset_check_has_a_description():
    defs = defs_from_env()
    specs = defs.resolve_all_asset_specs()
    assert len(specs) >= 13
    assert not [s.key.to_user_string() for s in specs if not (s.description or "").strip()]
    checks = [c for s in specs for c in defs.resolve_assets_def(s.key).check_specs]
    assert checks and not [c.name for c in checks if not (c.description or "").strip()]


def test_every_column_of_every_asset_is_described_in_the_ui():
    undescribed = []
    for spec in defs_from_env().resolve_all_asset_specs():
        schema = spec.metadata.get("dagster/column_schema")
        assert isinstance(schema, dg.TableSchema), f"{spec.key.to_user_string()} shows no column schema"
        columns = schema.columns
        assert columns, spec.key.to_user_string()
        undescribed += [f"{spec.key.to_user_string()}.{c.name}" for c in columns if not (c.description or "").strip()]
    assert not undescribed, f"add these columns to COLUMN_DESCRIPTIONS in rules/descriptions.py: {undescribed}"


def test_every_job_and_sensor_has_a_description():
    defs = defs_from_env()
    jobs = [j for j in defs.resolve_all_job_defs() if not j.name.startswith("__")]  # Dagster's implicit job
    assert {"judge_job", "ledger_job", "filter_job", "across_runs_job"} <= {j.name for j in jobs}
    assert not [j.name for j in jobs if not (j.description or "").strip()]
    assert defs.sensors and not [s.name for s in defs.sensors if not (s.description or "").strip()]


def test_every_resource_field_has_a_description():
    resources = defs_from_env().resources
    assert {"data", "judge", "io_manager"} <= set(resources)
    undescribed = [
        f"{key}.{name}"
        for key, resource in resources.items()
        for name, field in type(resource).model_fields.items()
        # a nested resource (the IO manager's `data`) is wiring, not a config field the UI shows
        if not isinstance(getattr(resource, name), dg.ConfigurableResource) and not (field.description or "").strip()
    ]
    assert not undescribed, undescribed
    assert not [key for key, resource in resources.items() if not (type(resource).__doc__ or "").strip()]


def test_every_run_config_field_has_a_description():
    import filter_pipeline.definitions  # noqa: F401 - every Config class of the code location is imported

    resources = (dg.ConfigurableResource, dg.ConfigurableIOManagerFactory)  # the test above covers those
    configs = [c for c in _package_subclasses(dg.Config) if not issubclass(c, resources)]
    assert {"CapsConfig", "MacroCapsConfig", "LedgerConfig"} <= {c.__name__ for c in configs}
    undescribed = [
        f"{cls.__name__}.{name}"
        for cls in configs
        for name, field in cls.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not undescribed, undescribed
    assert not [cls.__name__ for cls in configs if not (cls.__doc__ or "").strip()]


# --- the code location's name ---------------------------------------------------------------------------


def test_the_workspace_names_the_code_location_filter_pipeline_and_loads_the_packages_defs():
    [entry] = yaml.safe_load((REPO / "workspace.yaml").read_text())["load_from"]
    module = entry["python_module"]
    assert module["location_name"] == LOCATION
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["dagster"]["code_location_name"] == LOCATION
    assert isinstance(getattr(importlib.import_module(module["module_name"]), module["attribute"]), dg.Definitions)


@pytest.mark.slow
def test_dagster_loads_the_workspace_as_the_filter_pipeline_location(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FILTER_", "DAGSTER_"))} | {
        "DAGSTER_HOME": str(home)
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Validation successful for code location {LOCATION}." in done.stderr + done.stdout
