"""The README's example of reading the outputs with pandas does what its comments say, on files as the pipeline
writes them."""

import re
from pathlib import Path

import pandas as pd

from filter_pipeline.rules.schemas import conform, parquet_bytes, to_arrow

README = Path(__file__).resolve().parents[1] / "README.md"


def reading_example() -> str:
    """The README's Python block that reads the failure pool."""
    [block] = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL) if "failure_pool" in b]
    return block


def write_asset(data: Path, asset: str, run_id: str, frame: pd.DataFrame) -> None:
    """warehouse/<asset>/<run_id>.parquet with the asset's schema, as the IO manager writes it."""
    path = data / "warehouse" / asset / f"{run_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(parquet_bytes(to_arrow(conform(frame.assign(run_id=run_id), asset), asset), asset).to_pybytes())


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
    exec(reading_example(), names)

    assert names["negatives"]["task_id"].tolist() == [
        "script-failed",
        "judge-said-nothing-of-blocked",
        "judge-said-not-blocked",
    ]
    assert names["kept"]["task_id"].tolist() == ["kept-task"]
