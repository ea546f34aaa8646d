"""The code location: wires assets, jobs, the sensor and resources. Settings come from the environment."""

import warnings

import dagster as dg

from filter_pipeline.judge.resource import JudgeResource, judge_from_env
from filter_pipeline.settings import DEFAULT_EXECUTOR, EXECUTOR_ENV, check_whole_number_settings, executor_name
from filter_pipeline.shell.assets import (
    build_coverage,
    judge_batch,
    judge_calibration,
    warehouse_verified,
)
from filter_pipeline.shell.config import caps_from_env
from filter_pipeline.shell.freshness import build_labels_sensor, build_retired_sensor
from filter_pipeline.shell.jobs import across_runs_job, filter_job, judge_job, ledger_job, rejudge_job
from filter_pipeline.shell.ledger import build_ledger
from filter_pipeline.shell.sensors import build_batch_sensor
from filter_pipeline.shell.warehouse import DataRoot, WarehouseIOManager

# Intended: the ledger walks a single-run backfill's partitions in one step, in run_id order; the other assets
# run one partition per run. Dagster warns about the mix whenever it resolves a job holding both.
warnings.filterwarnings("ignore", message=r"Asset job \w+ materializes assets with varying BackfillPolicies")

# by each executor's own name (settings.py says when to choose which)
EXECUTORS = {e.name: e for e in (dg.in_process_executor, dg.multiprocess_executor)}


def build_defs(
    data: DataRoot | str, judge: JudgeResource, caps: dict, executor: str = DEFAULT_EXECUTOR
) -> dg.Definitions:
    """All definitions for one data root, judge, caps and executor (`defs_from_env` reads them from the
    environment, for `defs` and the CLI's runs). `caps`: the deployment's caps, the default of every run's caps config (the launchpad shows them; the
    sensor and the CLI pass none unless told). Raises ValueError for an unknown executor name."""
    if executor not in EXECUTORS:
        raise ValueError(f"{EXECUTOR_ENV}={executor!r}: expected one of {', '.join(EXECUTORS)}")
    data = data if isinstance(data, DataRoot) else DataRoot(path=data)
    return dg.Definitions(
        assets=[
            judge_batch,
            build_ledger(caps),
            build_coverage(caps),
            judge_calibration,
        ],
        asset_checks=[warehouse_verified],
        jobs=[judge_job, ledger_job, filter_job, across_runs_job, rejudge_job],
        sensors=[build_batch_sensor(), build_labels_sensor(), build_retired_sensor()],
        resources={"data": data, "judge": judge, "io_manager": WarehouseIOManager(data=data)},
        executor=EXECUTORS[executor],
    )


def defs_from_env() -> dg.Definitions:
    check_whole_number_settings()
    return build_defs(
        data=DataRoot.from_env(),
        judge=judge_from_env(),
        caps=caps_from_env(),
        executor=executor_name(),
    )


defs = defs_from_env()
