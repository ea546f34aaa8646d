"""Small builders so each test reads as the rule it checks."""

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from upath import UPath

from filter_pipeline.rules.schemas import canonical_key, conform, key_hash
from filter_pipeline.rules.vocabulary import STATUS_JUDGED
from filter_pipeline.storage.runs import read_batch

if TYPE_CHECKING:
    import dagster as dg

    from filter_pipeline.judge.resource import JudgeResource


def task(task_id: str, macro: str = "m", site: str = "s", key: list | None = None, **extra) -> dict:
    """A tasks.jsonl record; the dedup key defaults to one unique to the task."""
    record = {
        "task_id": task_id,
        "macro": macro,
        "site": site,
        "instruction": f"do {task_id}",
        "dedup_key": key if key is not None else [site, "#el", task_id],
        "start": {"kind": "url"},
    }
    record.update(extra)
    return record


def attempt(
    task_id: str, n: int = 1, ok: bool = True, error: str | None = None, backend=..., steps: int = 2, **extra
) -> dict:
    """An executions.jsonl record; `backend` defaults to {"ok": ok, "detail": ...}, pass None for null."""
    record = {
        "task_id": task_id,
        "attempt": n,
        "ok": ok,
        "dir": f"runs/r/traj/{task_id}/{n}",
        "steps": [{"action": "click"}] * steps,
        "backend": {"ok": ok, "detail": f"detail {task_id}/{n}"} if backend is ... else backend,
    }
    if error is not None:
        record["error"] = error
    record.update(extra)
    return record


def jsonl(records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def write_batch(data: Path, run_id: str, tasks, attempts, complete: bool = True) -> Path:
    """Write runs/<run_id>/ with tasks.jsonl, executions.jsonl and (if complete) _SUCCESS."""
    run = UPath(data) / "runs" / run_id
    run.mkdir(parents=True, exist_ok=True)
    (run / "tasks.jsonl").write_text(jsonl(tasks))
    (run / "executions.jsonl").write_text(jsonl(attempts))
    if complete:
        (run / "_SUCCESS").write_text("")
    return run


def parse(tmp_path: Path, tasks, attempts, run_id: str = "r"):
    """Write a batch and parse it: the Batch of frames the assets see."""
    write_batch(tmp_path, run_id, tasks, attempts)
    return read_batch(UPath(tmp_path) / "runs" / run_id, run_id)


def verdicts(*rows: dict) -> pd.DataFrame:
    """judge_verdicts rows; each dict needs task_id and may set macro, site, key, passed, status."""
    out = []
    for row in rows:
        row = dict(row)
        tid = row.pop("task_id")
        key = row.pop("key", ["s", "#el", tid])
        out.append(
            {
                "task_id": tid,
                "macro": row.pop("macro", "m"),
                "site": row.pop("site", "s"),
                "dedup_key": canonical_key(key),
                "key_hash": key_hash(canonical_key(key)),
                "attempt": 1,
                "passed": row.pop("passed", True),
                "status": row.pop("status", STATUS_JUDGED),
                **row,
            }
        )
    return conform(pd.DataFrame(out), "judge_verdicts")


def kept_history(*rows: tuple) -> pd.DataFrame:
    """prior_dedup_index rows from (key, macro, site, run_id, task_id) tuples."""
    return conform(
        pd.DataFrame(
            [
                dict(
                    dedup_key=canonical_key(k),
                    key_hash=key_hash(canonical_key(k)),
                    macro=m,
                    site=s,
                    run_id=r,
                    task_id=t,
                )
                for k, m, s, r, t in rows
            ]  # fmt: skip
        ),
        "prior_dedup_index",
    )


def counts(*rows: tuple) -> pd.DataFrame:
    """prior_kept_counts rows from (macro, site, n_kept) tuples."""
    return conform(pd.DataFrame([dict(macro=m, site=s, n_kept=n) for m, s, n in rows]), "prior_kept_counts")


def write_kept(
    data: Path, run_id: str, *rows: tuple, commit: bool = True, history: dict | None = None, caps: dict | None = None
) -> None:
    """warehouse/kept/<run_id>.parquet from (task_id, key, macro, site) tuples, as the pipeline writes it, and
    (if `commit`) its commit record naming it (`history`: the runs its walk read; `caps`: the caps it used)."""
    from filter_pipeline.rules.schemas import to_arrow
    from filter_pipeline.storage.parquet import write_parquet

    frame = pd.DataFrame(
        [dict(task_id=t, dedup_key=canonical_key(k), key_hash=key_hash(canonical_key(k)), macro=m, site=s, run_id=run_id)
         for t, k, m, s in rows]
    )  # fmt: skip
    path = UPath(data) / "warehouse" / "kept" / f"{run_id}.parquet"
    write_parquet(to_arrow(frame, "kept"), path)
    if commit:
        commit_files(data, run_id, {"kept": path}, history=history, caps=caps, kept_keys=len(rows))


def commit_files(
    data: Path,
    run_id: str,
    files: dict,
    history: dict | None = None,
    caps: dict | None = None,
    kept_keys: int = 0,
    inputs: dict | None = None,
    **changes,
) -> None:
    """The commit record of `run_id` naming `files` ({asset: path}) as they are now (`changes`: other fields of
    the record, e.g. unjudged, walked_at)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from filter_pipeline.rules.commits import CommitRecord
    from filter_pipeline.storage.publish import file_entry, write_commit

    root = UPath(data)
    entries = {}
    for asset, path in files.items():
        data_bytes = UPath(path).read_bytes()
        try:
            rows = pq.read_metadata(pa.BufferReader(data_bytes)).num_rows
        except pa.ArrowException:
            rows = 0  # (a test's deliberately broken file)
        entries[asset] = file_entry(root, UPath(path), data_bytes, rows)
    record = CommitRecord(
        run_id=run_id, files=entries, kept_keys=kept_keys,
        caps=caps or {"per_site_cap": 3, "caps": {}}, caps_source="deployment",
        history=history or {}, inputs=inputs or {},
        **{"unjudged": 0, "walked_at": "2026-12-01T00:00:00+00:00",
           "judge": {"kind": "gate", "model": None, "prompt_version": None, "votes": None}, **changes},
    )  # fmt: skip
    write_commit(root / "warehouse", record)


def write_legacy_kept(data: Path, run_id: str, *rows: tuple) -> None:
    """runs/<run_id>/kept.jsonl (the earlier script's output) from (task_id, key, macro, site) tuples."""
    run = UPath(data) / "runs" / run_id
    run.mkdir(parents=True, exist_ok=True)
    (run / "kept.jsonl").write_text(
        jsonl(dict(task_id=t, dedup_key=k, macro=m, site=s, instruction="i") for t, k, m, s in rows)
    )


def rows(frame: pd.DataFrame, *cols: str) -> list[list]:
    """The frame's values as lists, with every missing value as None (pandas 3 reads null strings as NaN)."""
    part = frame[list(cols)].astype(object)
    return part.where(part.notna(), None).values.tolist()


# Key texts as a generator may write them: ones taken as written (already canonical), and ones parsed and
# encoded again (not canonical, or, like \u0001, canonical but outside the conservative match).
CANONICAL_KEY_TEXTS = [
    '["s","#a",1]', '["s","#a",0]', '["s","#a",-12]', "[]", '["sité","#a",true,false,null]',
    '["s","#a","\\n\\t\\"\\\\ \\b\\f\\r"]', '["s","#a",12345678901234567890]',
]  # fmt: skip
OTHER_KEY_TEXTS = [
    '["s","#a",-0]', '["s","#a",1E5]', '["s","#a",1.50]', '["s","#a","\\/x"]', '["s","#a","\\u00e9"]',
    '["s","#a","\\u0001"]', '["s","#a","\\u001F"]', '[ "s" ,"#a",1]', '["s","#a",1.0]',
]  # fmt: skip
RAW_KEYS = CANONICAL_KEY_TEXTS + OTHER_KEY_TEXTS


def chart_bars(svg: bytes) -> dict[str, dict[str, int]]:
    """What a bar chart shows: series name -> {label: value}, labels in top-down order (no bar: left out)."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)
    classes = lambda el: (el.get("class") or "").split()  # noqa: E731
    names = [next(t.text for t in g.iter() if t.text) for g in root.iter() if "legend" in classes(g)]
    shown: dict[str, dict[str, int]] = {}
    for group in (g for g in root.iter() if "series" in classes(g)):
        index = int(next(c for c in classes(group) if c.startswith("serie-")).removeprefix("serie-"))
        bars = []
        for bar in (g for g in group.iter() if "bar" in classes(g)):
            desc = {" ".join(classes(d)): d.text for d in bar if d.tag.endswith("desc")}
            rect = next(r for r in bar if r.tag.endswith("rect"))
            if rect.get("width") is not None:  # a missing value draws a rect without width
                bars.append((float(desc["y centered"]), desc["x_label"], int(desc["value"])))
        if bars:  # (a series' group is repeated for its text overlay, without bars)
            shown[names[index] if index < len(names) else f"serie-{index}"] = {label: v for _, label, v in sorted(bars)}
    return shown


class LogLines(logging.Handler):
    """The messages logged to a logger it is added to, at `level` and above (a sensor's log, for one)."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def sensor_context(instance, data_root, judge=None, cursor: str | None = None):
    """A sensor's evaluation context on `instance` with the resources the definitions give it: the data root at
    `data_root` and `judge` (default: the gate); `cursor`: the one the previous tick returned."""
    import dagster as dg

    from filter_pipeline.judge.resource import JudgeResource
    from filter_pipeline.shell.warehouse import DataRoot

    resources = {"data": DataRoot(path=str(data_root)), "judge": judge or JudgeResource()}
    return dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor)


class Pipeline:
    """Materializes partitions of the real definitions on one test instance."""

    def __init__(self, data_root: Path, instance: "dg.DagsterInstance"):
        self.data_root, self.instance = data_root, instance

    def run(
        self, judge: "JudgeResource", run_id: str = "r1", judging_only: bool = False
    ) -> "dg.ExecuteInProcessResult":
        """One run of filter_job; `judging_only`: only judge_batch's step (the batch, judge_verdicts and
        failure_pool), for tests that read nothing the ledger or the reports make."""
        if run_id not in self.instance.get_dynamic_partitions("run_id"):
            self.instance.add_dynamic_partitions("run_id", [run_id])
        from filter_pipeline.definitions import build_defs
        from filter_pipeline.shell.assets import judge_batch

        job = build_defs(str(self.data_root), judge, caps={}).resolve_job_def("filter_job")
        selection = list(judge_batch.keys) if judging_only else None
        result = job.execute_in_process(instance=self.instance, partition_key=run_id, asset_selection=selection)
        assert result.success
        return result

    def output(self, asset: str, run_id: str = "r1") -> pd.DataFrame:
        return pd.read_parquet(self.data_root / "warehouse" / asset / f"{run_id}.parquet")
