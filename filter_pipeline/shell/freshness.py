"""Keeping the across-runs assets current with the files they read beside the warehouse: `judge_calibration`
with labels.jsonl (the labels sensor), `coverage` with retired.json (the retired sensor).

Each asset records a fingerprint of the file it was built from in its materialization's metadata; it is stale
exactly when the file's fingerprint now differs. A sensor then refreshes that asset alone, and so does a
`filter-pipeline materialize` naming no run (`stale_across_runs`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import dagster as dg
from upath import UPath

from filter_pipeline.rules.calibration import LABELS_FILE
from filter_pipeline.rules.history import RETIRED_FILE
from filter_pipeline.rules.schemas import file_fingerprint
from filter_pipeline.shell.assets import LABELS_FINGERPRINT, LABELS_UNREADABLE, RETIRED_FINGERPRINT
from filter_pipeline.shell.jobs import across_runs_job
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.history import read_retired
from filter_pipeline.storage.labels import read_labels

FRESHNESS_SENSOR_INTERVAL_SECONDS = 30
CALIBRATION = dg.AssetKey("judge_calibration")
COVERAGE = dg.AssetKey("coverage")


@dataclass(frozen=True)
class Stale:
    """An across-runs asset built from another version of its file: the file's fingerprint now, the one the
    asset recorded (None: never built on this instance, or built before it recorded one), and the Dagster run
    that built it (None: none), which tells each refresh apart even when the file comes back to an earlier
    version."""

    current: str
    recorded: str | None
    built: str | None


@dataclass(frozen=True)
class Follows:
    """An across-runs asset's file beside the warehouse: its name, how it is read, the metadata entry the asset
    records its fingerprint under, and the warehouse folder the asset reads (without it there is nothing to
    refresh yet, and `nothing_yet` says so). `unreadable`: the fingerprint the asset records when it builds
    without a file that cannot be read; None: it refuses to build then."""

    file: str
    read: Callable[[UPath], bytes | None]
    entry: str
    needs: str
    nothing_yet: str
    unreadable: str | None = None

    def fingerprint(self, data: DataRoot) -> str:
        """The file's fingerprint now, as the asset would record it. A file that cannot be read raises the
        read's ValueError (one line) when the asset refuses to build without it."""
        try:
            return file_fingerprint(self.read(data.root), self.file)
        except ValueError:
            if self.unreadable is None:
                raise
            return self.unreadable

    def compare(self, instance: dg.DagsterInstance, asset: dg.AssetKey, data: DataRoot) -> Stale | None:
        """Stale when the asset's last materialization recorded another fingerprint of the file, else None. An
        asset never built (or built before it recorded one) is stale only if the file exists now."""
        current = self.fingerprint(data)
        event = instance.get_latest_materialization_event(asset)
        found = event.asset_materialization.metadata.get(self.entry) if event and event.asset_materialization else None
        recorded = found.value if found is not None else None
        if recorded == current or (recorded is None and current == file_fingerprint(None, self.file)):
            return None
        return Stale(current, recorded, event.run_id if event else None)

    def stale(self, instance: dg.DagsterInstance, asset: dg.AssetKey, data: DataRoot) -> Stale | None:
        """`compare`, when there is something to refresh (else None)."""
        return self.compare(instance, asset, data) if (data.warehouse / self.needs).exists() else None


FOLLOWS = {
    CALIBRATION: Follows(LABELS_FILE, read_labels, LABELS_FINGERPRINT, "judge_verdicts",
                         "nothing to score yet: no judge_verdicts in the warehouse", LABELS_UNREADABLE),
    COVERAGE: Follows(RETIRED_FILE, read_retired, RETIRED_FINGERPRINT, "kept",
                      "nothing to count yet: no kept in the warehouse"),
}  # fmt: skip


def stale_across_runs(instance: dg.DagsterInstance, data: DataRoot) -> dict[dg.AssetKey, Stale]:
    """The across-runs assets stale with the file each follows."""
    found = {asset: follows.stale(instance, asset, data) for asset, follows in FOLLOWS.items()}
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
        try:
            stale = follows.compare(context.instance, asset, data)
        except ValueError as exc:  # (the asset cannot be built from the file as it is: a refresh would fail)
            return dg.SensorResult(skip_reason=f"{exc}: {asset.path[-1]} is refreshed once it can be read")
        if stale is None:
            return dg.SensorResult(skip_reason=f"{asset.path[-1]} is up to date with {follows.file}")
        context.log.info(f"{follows.file} changed ({stale.recorded} -> {stale.current}): refreshing {asset.path[-1]}")
        # (a run key is run once: the materialization it refreshes makes it new when the file comes back to an
        # earlier version)
        key = f"{follows.file}:{stale.built}:{stale.current}"
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
