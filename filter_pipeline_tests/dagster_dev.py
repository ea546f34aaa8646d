"""A real `dagster dev` on loopback, driven through its GraphQL API with the mutations the UI sends.

`DagsterDev` starts `dagster dev -w workspace.yaml` (daemon, webserver, code server) in a fresh
`DAGSTER_HOME` (a copy of `instance/dagster.yaml`) over a given data root, waits until the code location
is loaded, and stops the whole process group (SIGTERM, then SIGKILL after a grace period: a process
started from a background shell may ignore SIGINT). Its methods are the UI's own GraphQL operations:

- `add_dynamic_partition`: the "Add partition" dialog (`addDynamicPartition`);
- `launch_job_backfill`: the partition picker of a job page ("Materialize..." on `filter_job`, several
  partitions), a job backfill (`launchPartitionBackfill` with a partition-set selector);
- `launch_asset_backfill`: "Materialize all" / "Materialize selected" on the asset graph, an asset
  backfill (`launchPartitionBackfill` with an asset selection and partition names, no selector);
- `start_sensor` / `stop_sensor`: the sensor's switch; `dismiss_community_dialog`: the first visit's "Skip";
  plus queries for backfills, runs and sensors.

Used by the end-to-end and backfill tests, `benchmarks/backfill_order.py` and `scripts/screenshots.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filter_pipeline_tests.servers import free_port, stop_process_group

REPO = Path(__file__).resolve().parent.parent
PARTITIONS_DEF = "run_id"  # the dynamic partitions definition of every per-run asset
SENSOR = "batch_sensor"
START_SECONDS = 180
STOP_GRACE_SECONDS = 30
# a backfill is over once it reaches one of these (BulkActionStatus)
BACKFILL_DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
RUN_DONE = {"SUCCESS", "FAILURE", "CANCELED"}
UI_TAGS = [{"key": "dagster/from_ui", "value": "true"}]  # what the UI adds to every backfill it launches

_PYTHON_ERROR = "... on PythonError { message stack }"
_LAUNCH_BACKFILL = f"""
mutation LaunchPartitionBackfill($backfillParams: LaunchBackfillParams!) {{
  launchPartitionBackfill(backfillParams: $backfillParams) {{
    __typename
    ... on LaunchBackfillSuccess {{ backfillId }}
    ... on PartitionSetNotFoundError {{ message }}
    ... on PartitionKeysNotFoundError {{ message }}
    ... on UnauthorizedError {{ message }}
    ... on PipelineNotFoundError {{ message }}
    ... on RunConflict {{ message }}
    ... on ConflictingExecutionParamsError {{ message }}
    ... on RunConfigValidationInvalid {{ pipelineName errors {{ message path reason }} }}
    {_PYTHON_ERROR}
  }}
}}"""
_ADD_PARTITION = f"""
mutation AddDynamicPartitionMutation($partitionsDefName: String!, $partitionKey: String!,
                                     $repositorySelector: RepositorySelector!) {{
  addDynamicPartition(partitionsDefName: $partitionsDefName, partitionKey: $partitionKey,
                      repositorySelector: $repositorySelector) {{
    __typename
    ... on AddDynamicPartitionSuccess {{ partitionsDefName partitionKey }}
    ... on UnauthorizedError {{ message }}
    ... on DuplicateDynamicPartitionError {{ message }}
    {_PYTHON_ERROR}
  }}
}}"""
_START_SENSOR = f"""
mutation StartSensor($sensorSelector: SensorSelector!) {{
  startSensor(sensorSelector: $sensorSelector) {{
    __typename
    ... on Sensor {{ id sensorState {{ id status }} }}
    ... on SensorNotFoundError {{ message }}
    ... on UnauthorizedError {{ message }}
    {_PYTHON_ERROR}
  }}
}}"""
_STOP_SENSOR = f"""
mutation StopRunningSensor($id: String!) {{
  stopSensor(id: $id) {{
    __typename
    ... on StopSensorMutationResult {{ instigationState {{ id status }} }}
    ... on UnauthorizedError {{ message }}
    {_PYTHON_ERROR}
  }}
}}"""
_SENSOR = f"""
query SensorRootQuery($sensorSelector: SensorSelector!) {{
  sensorOrError(sensorSelector: $sensorSelector) {{
    __typename
    ... on Sensor {{ id name sensorState {{ id status ticks(limit: 1) {{ status timestamp }} }} }}
    ... on SensorNotFoundError {{ message }}
    {_PYTHON_ERROR}
  }}
}}"""
_BACKFILL = f"""
query SingleBackfillQuery($backfillId: String!) {{
  partitionBackfillOrError(backfillId: $backfillId) {{
    __typename
    ... on PartitionBackfill {{
      id status isAssetBackfill partitionNames numPartitions timestamp endTimestamp
      error {{ message }}
    }}
    ... on BackfillNotFoundError {{ message }}
    {_PYTHON_ERROR}
  }}
}}"""
_RUNS = f"""
query RunsRootQuery($filter: RunsFilter, $limit: Int) {{
  runsOrError(filter: $filter, limit: $limit) {{
    __typename
    ... on Runs {{ results {{ runId jobName status startTime endTime creationTime tags {{ key value }} }} }}
    ... on InvalidPipelineRunsFilterError {{ message }}
    {_PYTHON_ERROR}
  }}
}}"""
_LOCATIONS = """
query Locations {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name loadStatus
        locationOrLoadError {
          __typename
          ... on RepositoryLocation { repositories { name } }
          ... on PythonError { message }
        }
      }
    }
  }
}"""
_PARTITION_KEYS = """
query PartitionKeys($assetKey: AssetKeyInput!) {
  assetNodeOrError(assetKey: $assetKey) { ... on AssetNode { partitionKeys } }
}"""
_ASSET_KEYS = "{ assetNodes { assetKey { path } } }"


class GraphQLError(RuntimeError):
    """The endpoint answered with errors, or a mutation returned an error type; the message says which."""


@dataclass(frozen=True)
class Run:
    run_id: str
    job: str
    status: str
    tags: dict[str, str]
    start: float | None
    end: float | None
    created: float

    @property
    def partition(self) -> str | None:
        return self.tags.get("dagster/partition")


class DagsterDev:
    """`dagster dev` in its own process group over `data`, with `home` as DAGSTER_HOME (created with the
    project's dagster.yaml when it has none). Use as a context manager: up and loaded on enter, stopped
    (with everything it started) on exit."""

    def __init__(self, home: Path, data: Path, env: dict | None = None, port: int | None = None):
        self.home, self.data = Path(home), Path(data)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {}), "DAGSTER_HOME": str(self.home), "FILTER_PIPELINE_DATA": str(self.data)}
        self.log_path = self.home / "dagster-dev.log"
        self.proc: subprocess.Popen | None = None
        self.location = self.repository = ""

    # --- process --------------------------------------------------------------------------------------

    def start(self, seconds: float = START_SECONDS) -> DagsterDev:
        self.home.mkdir(parents=True, exist_ok=True)
        if not (self.home / "dagster.yaml").exists():
            shutil.copy(REPO / "instance" / "dagster.yaml", self.home / "dagster.yaml")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml",
             "-h", "127.0.0.1", "-p", str(self.port)],
            cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: daemon, webserver, code server and runs go down together
        )  # fmt: skip
        try:
            self._wait_until_loaded(seconds)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_loaded(self, seconds: float) -> None:
        deadline = time.time() + seconds
        last = "no answer"
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                entries = self.graphql(_LOCATIONS)["workspaceOrError"]["locationEntries"]
                loaded = [
                    e
                    for e in entries
                    if e["locationOrLoadError"] and e["locationOrLoadError"]["__typename"] == "RepositoryLocation"
                ]
                errors = [
                    e
                    for e in entries
                    if e["locationOrLoadError"] and e["locationOrLoadError"]["__typename"] == "PythonError"
                ]
                if errors:
                    raise RuntimeError(
                        f"code location {errors[0]['name']} failed to load: {errors[0]['locationOrLoadError']['message']}"
                    )
                if loaded:
                    self.location = loaded[0]["name"]
                    self.repository = loaded[0]["locationOrLoadError"]["repositories"][0]["name"]
                    return
                last = f"locations: {[(e['name'], e['loadStatus']) for e in entries]}"
            except (OSError, GraphQLError) as exc:
                last = str(exc)
            time.sleep(1)
        raise TimeoutError(
            f"dagster dev did not load the code location within {seconds:.0f} s ({last}):\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_seconds=STOP_GRACE_SECONDS)
            self._log.close()
            self.proc = None

    def __enter__(self) -> DagsterDev:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    # --- GraphQL --------------------------------------------------------------------------------------

    def graphql(self, query: str, variables: dict | None = None, timeout: float = 60) -> dict:
        """POST one operation to /graphql; its `data`, or GraphQLError with the errors it answered."""
        request = urllib.request.Request(
            f"{self.url}/graphql",
            data=json.dumps({"query": query, "variables": variables or {}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # GraphQL validation errors come back as 400 with a body
            payload = json.loads(exc.read() or b"{}")
        if payload.get("errors"):
            raise GraphQLError("; ".join(e.get("message", str(e)) for e in payload["errors"]))
        return payload["data"]

    @staticmethod
    def _expect(result: dict, typename: str) -> dict:
        if result["__typename"] != typename:
            detail = result.get("message") or result.get("errors") or result
            raise GraphQLError(f"expected {typename}, got {result['__typename']}: {detail}")
        return result

    @property
    def repository_selector(self) -> dict:
        return {"repositoryLocationName": self.location, "repositoryName": self.repository}

    def sensor_selector(self, name: str = SENSOR) -> dict:
        return {**self.repository_selector, "sensorName": name}

    # --- what the UI does -----------------------------------------------------------------------------

    def add_dynamic_partition(self, key: str, partitions_def: str = PARTITIONS_DEF) -> None:
        result = self.graphql(
            _ADD_PARTITION,
            {"partitionsDefName": partitions_def, "partitionKey": key, "repositorySelector": self.repository_selector},
        )["addDynamicPartition"]
        self._expect(result, "AddDynamicPartitionSuccess")

    def launch_job_backfill(self, job: str, partitions: list[str], run_config: str | None = None) -> str:
        """A job's partition picker ("Launch backfill" on the job page): one run per partition, launched in
        the order given (the UI gives the partitions in the definition's order, i.e. registration order for
        dynamic partitions). Returns the backfill id."""
        params = {
            "tags": UI_TAGS,
            "assetSelection": [{"path": key} for key in self.job_asset_keys(job)],
            "partitionNames": partitions,
            "fromFailure": False,
            "selector": {"partitionSetName": f"{job}_partition_set", "repositorySelector": self.repository_selector},
        }
        if run_config is not None:
            params["runConfigData"] = run_config
        return self._launch(params)

    def launch_asset_backfill(self, partitions: list[str], assets: list[list[str]] | None = None) -> str:
        """ "Materialize all" (assets None) or "Materialize selected" on the asset graph, with partitions
        chosen in the dialog: an asset backfill that plans runs by the assets' backfill policies."""
        keys = assets if assets is not None else self.asset_keys()
        return self._launch(
            {
                "tags": UI_TAGS,
                "assetSelection": [{"path": k} for k in keys],
                "partitionNames": partitions,
                "fromFailure": False,
            }
        )

    def _launch(self, params: dict) -> str:
        result = self.graphql(_LAUNCH_BACKFILL, {"backfillParams": params})["launchPartitionBackfill"]
        return self._expect(result, "LaunchBackfillSuccess")["backfillId"]

    def sensor(self, name: str = SENSOR) -> dict:
        return self._expect(
            self.graphql(_SENSOR, {"sensorSelector": self.sensor_selector(name)})["sensorOrError"], "Sensor"
        )

    def sensor_status(self, name: str = SENSOR) -> str:
        return self.sensor(name)["sensorState"]["status"]

    def start_sensor(self, name: str = SENSOR) -> None:
        result = self.graphql(_START_SENSOR, {"sensorSelector": self.sensor_selector(name)})["startSensor"]
        self._expect(result, "Sensor")

    def stop_sensor(self, name: str = SENSOR) -> None:
        result = self.graphql(_STOP_SENSOR, {"id": self.sensor(name)["sensorState"]["id"]})["stopSensor"]
        state = self._expect(result, "StopSensorMutationResult")["instigationState"]
        if state["status"] != "STOPPED":
            raise GraphQLError(f"sensor {name} is {state['status']} after stopSensor")
        deadline = time.time() + 60  # a tick that began before the stop still runs to its end
        while time.time() < deadline and any(
            t["status"] == "STARTED" for t in self.sensor(name)["sensorState"]["ticks"]
        ):
            time.sleep(0.5)

    def dismiss_community_dialog(self) -> None:
        """The "Skip" of the UI's first-visit community dialog (`setNuxSeen`, stored in DAGSTER_HOME)."""
        self.graphql("mutation SetNuxSeen { setNuxSeen }")

    # --- queries --------------------------------------------------------------------------------------

    def asset_keys(self) -> list[list[str]]:
        return [n["assetKey"]["path"] for n in self.graphql(_ASSET_KEYS)["assetNodes"]]

    def job_asset_keys(self, job: str) -> list[list[str]]:
        query = """query($selector: PipelineSelector!) { pipelineOrError(params: $selector) {
            __typename ... on Pipeline { solidHandles { solid { definition { assetNodes { assetKey { path } } } } } }
            ... on PipelineNotFoundError { message } } }"""
        result = self.graphql(query, {"selector": {**self.repository_selector, "pipelineName": job}})["pipelineOrError"]
        handles = self._expect(result, "Pipeline")["solidHandles"]
        keys = [n["assetKey"]["path"] for h in handles for n in h["solid"]["definition"]["assetNodes"]]
        return sorted({tuple(k): k for k in keys}.values())

    def partition_keys(self, asset: str = "kept") -> list[str]:
        """The run_id partitions as the UI lists them (registration order)."""
        return self.graphql(_PARTITION_KEYS, {"assetKey": {"path": [asset]}})["assetNodeOrError"]["partitionKeys"]

    def backfill(self, backfill_id: str) -> dict:
        result = self.graphql(_BACKFILL, {"backfillId": backfill_id})["partitionBackfillOrError"]
        return self._expect(result, "PartitionBackfill")

    def runs(self, tags: dict[str, str] | None = None, job: str | None = None) -> list[Run]:
        """Runs (newest first, as the runs page lists them), filtered by tags and job."""
        run_filter: dict = {}
        if tags:
            run_filter["tags"] = [{"key": k, "value": v} for k, v in tags.items()]
        if job:
            run_filter["pipelineName"] = job
        result = self._expect(self.graphql(_RUNS, {"filter": run_filter, "limit": 1000})["runsOrError"], "Runs")
        return [
            Run(
                r["runId"],
                r["jobName"],
                r["status"],
                {t["key"]: t["value"] for t in r["tags"]},
                r["startTime"],
                r["endTime"],
                r["creationTime"],
            )
            for r in result["results"]
        ]

    def backfill_runs(self, backfill_id: str) -> list[Run]:
        return self.runs(tags={"dagster/backfill": backfill_id})

    def wait_for_backfill(self, backfill_id: str, seconds: float, poll: float = 2) -> dict:
        """Wait until the backfill is over and none of its runs is in flight; its final state. TimeoutError
        (with the runs' states and the log tail) when that takes longer than `seconds`."""
        deadline = time.time() + seconds
        while True:
            state = self.backfill(backfill_id)
            runs = self.backfill_runs(backfill_id)
            if state["status"] in BACKFILL_DONE and all(r.status in RUN_DONE for r in runs):
                return state
            if time.time() > deadline:
                summary = [(r.job, r.partition, r.status) for r in runs]
                raise TimeoutError(
                    f"backfill {backfill_id} still {state['status']} after {seconds:.0f} s; runs {summary}\n{self.log_tail()}"
                )
            time.sleep(poll)

    def wait_for_runs(self, done, seconds: float, poll: float = 2) -> list[Run]:
        """Wait until `done(runs)` holds for every run of the instance and none is in flight."""
        deadline = time.time() + seconds
        while True:
            runs = self.runs()
            if runs and all(r.status in RUN_DONE for r in runs) and done(runs):
                return runs
            if time.time() > deadline:
                raise TimeoutError(
                    f"runs not done after {seconds:.0f} s: {[(r.job, r.partition, r.status) for r in runs]}\n{self.log_tail()}"
                )
            time.sleep(poll)


@contextmanager
def dagster_dev(
    data: Path, home: Path | None = None, env: dict | None = None, sensor: bool = True
) -> Iterator[DagsterDev]:
    """`dagster dev` over `data` in a fresh DAGSTER_HOME (a temp dir unless `home` is given); with
    `sensor=False` the batch sensor is stopped (through the UI's mutation) before this yields. The sensor
    starts RUNNING with the code location: write batches only once it is stopped, or it registers them."""
    temp = None
    if home is None:
        temp = tempfile.mkdtemp(prefix="filter-dagster-home-")
        home = Path(temp)
    try:
        with DagsterDev(home, data, env) as server:
            if not sensor:
                server.stop_sensor()
            yield server
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
