"""The README's examples of reading the outputs with pandas do what their comments say, on files as the pipeline
writes them."""

import re
from pathlib import Path

import pandas as pd

from filter_pipeline.rules.schemas import conform
from filter_pipeline.rules.vocabulary import STATUS_ERROR
from filter_pipeline.storage.parquet import encode
from filter_pipeline_tests.builders import verdicts

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example(reading: str) -> str:
    """The README's Python block that reads the folder `reading` (e.g. "warehouse/failure_pool")."""
    found = [b for b in re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S) if reading in b]
    assert len(found) == 1, f"README.md: {len(found)} python blocks read {reading}, expected one"
    return found[0]


def write_asset(data: Path, asset: str, run_id: str, frame: pd.DataFrame) -> None:
    """warehouse/<asset>/<run_id>.parquet with the asset's schema, as the IO manager writes it."""
    path = data / "warehouse" / asset / f"{run_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    _, content = encode(conform(frame.assign(run_id=run_id), asset), asset)
    path.write_bytes(content.to_pybytes())


def pool_row(task_id: str, stage: str, backend_ok: bool | None = None, blocked: bool | None = None) -> dict:
    return {"task_id": task_id, "stage": stage, "backend_ok": backend_ok, "blocked": blocked}


def test_the_readmes_clean_negatives_are_failed_attempts_not_backend_ok_and_judge_failures_not_blocked(
    tmp_path, monkeypatch
):
    data, run_id = tmp_path / "data", "2026-11-28"
    pool = [
        pool_row("script-failed", "execute", backend_ok=False),
        pool_row("reached-the-goal", "execute", backend_ok=True),
        pool_row("judge-said-nothing-of-blocked", "judge"),  # a v2 prompt's verdict: blocked is null
        pool_row("judge-said-not-blocked", "judge", blocked=False),
        pool_row("judge-said-blocked", "judge", blocked=True),
    ]
    write_asset(data, "failure_pool", run_id, pd.DataFrame(pool))
    write_asset(data, "kept", run_id, pd.DataFrame({"task_id": ["kept-task"]}))
    write_asset(data, "dpo_pairs", run_id, pd.DataFrame({"task_id": ["kept-task"]}))
    monkeypatch.chdir(tmp_path)

    names: dict = {}
    exec(readme_example("warehouse/failure_pool"), names)

    assert names["negatives"]["task_id"].tolist() == [
        "script-failed",
        "judge-said-nothing-of-blocked",
        "judge-said-not-blocked",
    ]
    assert names["kept"]["task_id"].tolist() == ["kept-task"]


def test_the_readmes_verdict_queries_find_the_judge_contradicting_itself_and_the_sites_that_block(
    tmp_path, monkeypatch
):
    judged = verdicts(
        {"task_id": "contradicted", "site": "s1", "success": False},
        {"task_id": "agreed", "site": "s1", "success": True},
        {"task_id": "by-the-gate", "site": "s1"},  # the gate says nothing of success: null
        {"task_id": "blocked-1", "site": "s2", "passed": False, "blocked": True},
        {"task_id": "blocked-2", "site": "s2", "passed": False, "blocked": True},
        {"task_id": "blocked-3", "site": "s3", "passed": False, "blocked": True},
        {"task_id": "not-blocked", "site": "s3", "passed": False, "blocked": False},
        {"task_id": "unjudged", "site": "s1", "passed": None, "status": STATUS_ERROR},
    )
    write_asset(tmp_path / "data", "judge_verdicts", "2026-11-28", judged)
    monkeypatch.chdir(tmp_path)

    names: dict = {"pd": pd}  # (imported by the README's first example)
    exec(readme_example("warehouse/judge_verdicts"), names)

    assert names["contradicted"]["task_id"].tolist() == ["contradicted"]
    assert names["blocking"].to_dict() == {"s2": 2, "s3": 1}
