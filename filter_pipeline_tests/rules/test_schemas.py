"""Canonical key texts and their hashes, in bulk and one by one; every column described."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from filter_pipeline.rules.descriptions import ASSET_COLUMN_DESCRIPTIONS, column_description
from filter_pipeline.rules.schemas import (
    COLUMN_DESCRIPTIONS,
    SCHEMAS,
    canonical_key,
    key_hash,
    key_hashes,
    to_arrow,
    to_pandas,
)
from filter_pipeline_tests.builders import RAW_KEYS
from filter_pipeline_tests.conftest import REPO


def test_key_hashes_equal_key_hash_one_by_one():
    texts = [canonical_key(json.loads(raw)) for raw in RAW_KEYS] + [canonical_key(["k", i]) for i in range(64)]
    hashes = key_hashes(texts)
    assert hashes.dtype == np.int64 and hashes.tolist() == [key_hash(t) for t in texts]
    assert hashes.min() < 0 < hashes.max()  # both signs: the digest is read as a signed integer
    assert key_hashes([]).tolist() == []


def test_to_arrow_gives_the_schema_with_missing_columns_null_and_extra_ones_dropped():
    frame = pd.DataFrame({"extra": [1, 2], "attempt": pd.array([3, None], dtype="Int64"), "task_id": ["t1", "t2"]})
    table = to_arrow(frame, "judge_verdicts")
    assert table.schema.remove_metadata() == SCHEMAS["judge_verdicts"]
    assert table["task_id"].to_pylist() == ["t1", "t2"] and table["attempt"].to_pylist() == [3, None]
    assert all(table[name].null_count == 2 for name in SCHEMAS["judge_verdicts"].names if name not in frame)
    read = pd.read_parquet(_written(table))  # plain pandas: nullable ints stay nullable, texts are text
    assert read["attempt"].dtype == "Int64" and read["task_id"].tolist() == ["t1", "t2"]
    assert to_pandas(table).equals(to_pandas(to_arrow(to_pandas(table), "judge_verdicts")))


def _written(table: pa.Table) -> pa.BufferReader:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return pa.BufferReader(sink.getvalue())


def test_every_column_of_every_schema_has_a_description():
    missing = sorted({f"{asset}.{name}" for asset, schema in SCHEMAS.items() for name in schema.names
                      if not COLUMN_DESCRIPTIONS.get(name, "").strip()})  # fmt: skip
    assert not missing, f"add these columns to COLUMN_DESCRIPTIONS in rules/descriptions.py: {missing}"


def test_no_description_is_left_for_a_column_no_schema_has():
    stale = set(COLUMN_DESCRIPTIONS) - {name for schema in SCHEMAS.values() for name in schema.names}
    assert not stale, f"COLUMN_DESCRIPTIONS describes columns no schema has: {sorted(stale)}"
    stale = [f"{a}.{c}" for a, columns in ASSET_COLUMN_DESCRIPTIONS.items() for c in columns
             if a not in SCHEMAS or c not in SCHEMAS[a].names]  # fmt: skip
    assert not stale, f"ASSET_COLUMN_DESCRIPTIONS describes columns their asset does not have: {stale}"


def test_a_column_that_means_something_else_in_one_asset_says_so_there_only():
    assert "kept this key" in column_description("prior_dedup_index", "run_id")
    assert "kept this key" not in column_description("kept", "run_id")
    assert "judge rows" in column_description("failure_pool", "backend_ok")
    assert "judge rows" not in column_description("batch_attempts", "backend_ok")  # (it has none)
    assert "(all)" in column_description("judge_calibration", "site") and "(all)" not in column_description(
        "kept", "site"
    )


def test_the_contract_page_names_every_asset_and_column():
    page = (REPO / "docs" / "contract.md").read_text()
    missing = [f"{asset}.{name}" for asset, schema in SCHEMAS.items() for name in [asset, *schema.names]
               if f"`{name}`" not in page]  # fmt: skip
    assert not missing, f"docs/contract.md (section 5, Outputs) does not name: {missing}"


def test_the_contract_page_lists_each_assets_columns_in_the_files_order():
    page = (REPO / "docs" / "contract.md").read_text()
    listed = {}
    for bullet in re.split(r"\n- \*\*", page)[1:]:  # ("- **`asset`** ...": one asset's paragraph)
        asset = bullet[1:].split("`", 1)[0]
        if asset in SCHEMAS:
            names = SCHEMAS[asset].names
            first_mentions = list(dict.fromkeys(t for t in re.findall(r"`([^`]+)`", bullet) if t in names))
            if len(first_mentions) == len(names):  # (kept and surplus name theirs by reference)
                listed[asset] = first_mentions
    assert {"judge_verdicts", "failure_pool", "coverage", "dpo_pairs"} <= set(listed)
    assert {asset: names for asset, names in listed.items() if names != SCHEMAS[asset].names} == {}


EXIT_AFTER_READING = (
    "import sys; from filter_pipeline.storage.parquet import read_parquet_file; "
    "f = open(sys.argv[1], 'rb'); print(read_parquet_file(f, columns=['a']).num_rows)"
)
RUNS = 40


@pytest.mark.slow
def test_a_process_that_reads_a_parquet_file_and_exits_at_once_exits_cleanly(tmp_path):
    # A file object, as the warehouse reads one. With `pq.read_table` such a process aborted at exit in
    # about one run of eight on this project's CI machine (apache/arrow#34314): all RUNS would pass by chance
    # well under once in a hundred tries.
    path = tmp_path / "small.parquet"
    pq.write_table(pa.table({"a": list(range(1000)), "b": [str(i) for i in range(1000)]}), path)
    command = [sys.executable, "-c", EXIT_AFTER_READING, str(path)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(
            pool.map(lambda _: subprocess.run(command, capture_output=True, text=True, timeout=60), range(RUNS))
        )
    assert [(r.returncode, r.stdout.strip()) for r in runs] == [(0, "1000")] * RUNS, [r.stderr[-300:] for r in runs]


@pytest.mark.parametrize(
    "problem, evidence, kind",
    [
        (None, "trajectory", "trajectory"),
        ("trajectory.json missing", "record_steps: trajectory.json missing", "record_steps: trajectory.json missing"),
        ("trajectory.json not JSON (Expecting value)", "record_steps: trajectory.json not JSON (Expecting value)",
         "record_steps: trajectory.json not JSON"),
        ("trajectory.json has no steps list", "trajectory, record_steps: trajectory.json has no steps list",
         "trajectory, record_steps: trajectory.json has no steps list"),
    ],
)  # fmt: skip
def test_evidence_is_made_and_read_back_by_one_pair_of_rules(problem, evidence, kind):
    from filter_pipeline.rules.schemas import evidence_kind, evidence_problem, evidence_value

    assert evidence_value(problem) == evidence
    assert evidence_problem(evidence) == problem and evidence_kind(evidence) == kind


def test_votes_are_written_and_read_back_by_one_rule():
    from filter_pipeline.rules.schemas import votes_asked, votes_text
    from filter_pipeline.rules.vocabulary import GATE_VOTES

    assert votes_text(2, 3) == "2/3" and votes_asked(votes_text(2, 3)) == "3"
    assert votes_asked(GATE_VOTES) == GATE_VOTES
