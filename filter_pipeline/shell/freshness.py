"""Keeping the across-runs assets current with the files they read beside the warehouse: `judge_calibration`
with labels.jsonl (the labels sensor), `coverage` with retired.json (the retired sensor).

Each asset records a fingerprint of the file it was built from in its materialization's metadata; it is stale
exactly when the file's fingerprint now differs. A sensor then refreshes that asset alone, and so does a
`filter-pipeline materialize` naming no run (`stale_across_runs`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import dagster as dg

from filter_pipeline.rules.calibration import labels_fingerprint
from filter_pipeline.rules.history import NO_RETIRED, retired_fingerprint
from filter_pipeline.shell.assets import LABELS_FINGERPRINT, NO_LABELS, RETIRED_FINGERPRINT
from filter_pipeline.shell.jobs import across_runs_job
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.history import read_retired
from filter_pipeline.storage.labels import read_labels

FRESHNESS_SENSOR_INTERVAL_SECONDS = 30
CALIBRATION = dg.AssetKey("judge_calibration")
COVERAGE = dg.AssetKey("coverage")

Stale = tuple[str, str | None]  # (the file's fingerprint now, the one the asset was last built from: None, never)


def _compare(instance: dg.DagsterInstance, asset: dg.AssetKey, entry: str, current: str, absent: str) -> Stale | None:
    """(current, recorded) when `asset`'s last materialization recorded another fingerprint under `entry`, else
    None. An asset never built (or built before it recorded one) is stale only if the file exists now."""
    event = instance.get_latest_materialization_event(asset)
    found = event.asset_materialization.metadata.get(entry) if event and event.asset_materialization else None
    recorded = found.value if found is not None else None
    if recorded == current or (recorded is None and current == absent):
        return None
    return current, recorded


def labels_vs_calibration(instance: dg.DagsterInstance, data: DataRoot) -> Stale | None:
    """Whether judge_calibration is stale with labels.jsonl: (now, recorded) when it is, else None."""
    current = labels_fingerprint(read_labels(data.root)) or NO_LABELS
    return _compare(instance, CALIBRATION, LABELS_FINGERPRINT, current, NO_LABELS)


def retired_vs_coverage(instance: dg.DagsterInstance, data: DataRoot) -> Stale | None:
    """Whether coverage is stale with retired.json: (now, recorded) when it is, else None."""
    current = retired_fingerprint(read_retired(data.root))
    return _compare(instance, COVERAGE, RETIRED_FINGERPRINT, current, NO_RETIRED)


@dataclass(frozen=True)
class Follows:
    """An across-runs asset's file beside the warehouse: its name, how the asset is compared with it, and the
    warehouse folder the asset reads (without it there is nothing to refresh yet, and `nothing_yet` says so)."""

    file: str
    compare: Callable[[dg.DagsterInstance, DataRoot], Stale | None]
    needs: str
    nothing_yet: str

    def stale(self, instance: dg.DagsterInstance, data: DataRoot) -> Stale | None:
        """(now, recorded) when the asset is stale and there is something to refresh, else None."""
        return self.compare(instance, data) if (data.warehouse / self.needs).exists() else None


FOLLOWS = {
    CALIBRATION: Follows("labels.jsonl", labels_vs_calibration, "judge_verdicts",
                         "nothing to score yet: no judge_verdicts in the warehouse"),
    COVERAGE: Follows("retired.json", retired_vs_coverage, "kept", "nothing to count yet: no kept in the warehouse"),
}  # fmt: skip


def stale_across_runs(instance: dg.DagsterInstance, data: DataRoot) -> dict[dg.AssetKey, Stale]:
    """The across-runs assets stale with the file each follows: asset -> (now, recorded)."""
    found = {asset: follows.stale(instance, data) for asset, follows in FOLLOWS.items()}
    return {asset: stale for asset, stale in found.items() if stale is not None}


def _freshness_sensor(name: str, asset: dg.AssetKey, description: str) -> dg.SensorDefinition:
    follows = FOLLOWS[asset]

    @dg.sensor(
        name=name,
        jobs=[across_runs_job],
        minimum_interval_seconds=FRESHNESS_SENSOR_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=description,
    )
    def sensor(context: dg.SensorEvaluationContext, data: DataRoot) -> dg.SensorResult:
        if not (data.warehouse / follows.needs).exists():
            return dg.SensorResult(skip_reason=follows.nothing_yet)
        stale = follows.compare(context.instance, data)
        if stale is None:
            return dg.SensorResult(skip_reason=f"{asset.path[-1]} is up to date with {follows.file}")
        current, recorded = stale
        context.log.info(f"{follows.file} changed ({recorded} -> {current}): refreshing {asset.path[-1]}")
        key = f"{follows.file.split('.')[0]}:{recorded}:{current}"
        return dg.SensorResult(
            run_requests=[dg.RunRequest(job_name=across_runs_job.name, asset_selection=[asset], run_key=key)]
        )

    return sensor


def build_labels_sensor() -> dg.SensorDefinition:
    """The labels sensor: new labels show in judge_calibration without waiting for a new batch."""
    return _freshness_sensor(
        "labels_sensor",
        CALIBRATION,
        "Refreshes judge_calibration (alone) when <data>/labels.jsonl changed since it was last built (a "
        "fingerprint of the file's bytes, recorded on each materialization), so new labels show without a new "
        "batch.",
    )


def build_retired_sensor() -> dg.SensorDefinition:
    """The retired sensor: rows retired.json retires leave coverage without waiting for a new batch."""
    return _freshness_sensor(
        "retired_sensor",
        COVERAGE,
        "Refreshes coverage (alone) when <data>/retired.json changed since it was last built (a fingerprint of "
        "the file's bytes, recorded on each materialization), so retired rows leave its counts without a new "
        "batch.",
    )
