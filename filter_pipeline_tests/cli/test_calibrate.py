"""`filter-pipeline calibrate`: a candidate judge on the labelled attempts only, against a real loopback
OpenAI-compatible server; its verdicts reused the second time; the warehouse's commits and outputs untouched."""

import hashlib
import json
import shutil
import subprocess

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.cli.main import main
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline_tests.builders import Pipeline, attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI
from filter_pipeline_tests.judge.test_resource import llm, sample_batch
from filter_pipeline_tests.judge.test_verdict_parts import v3
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply, error_body

LABELS = [
    {"dir": "runs/r/traj/a/1", "success": True, "labeler": "ann"},
    {"run_id": "r1", "task_id": "b", "success": False},  # the task's judged attempt
    {"dir": "runs/r/traj/e/1", "success": False},  # a failed attempt: the candidate judges it too
    {"dir": "runs/r/traj/c/1", "success": True},
    {"dir": "runs/r/traj/c/1", "success": None, "note": "not sure after all"},  # unsure: not judged
]


def fingerprint(warehouse) -> dict[str, str]:
    """Each file of the warehouse but the candidate's own, by its hash."""
    return {
        str(p.relative_to(warehouse)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(warehouse.rglob("*"))
        if p.is_file() and "judge_eval" not in p.parts
    }


@pytest.fixture
def labelled(data_root):
    """A filtered batch judged by the production model (it passes everything) and labels of some attempts."""
    sample_batch(data_root)
    with dg.DagsterInstance.ephemeral() as instance, FakeOpenAI() as production:
        Pipeline(data_root, instance).run(llm(production, price_per_million_prompt_tokens=1.0))
    (data_root / "labels.jsonl").write_text("".join(json.dumps(label) + "\n" for label in LABELS))
    return data_root


def candidate(call, n) -> Reply:
    """A stricter model: passes a only."""
    return Reply(content=v3("do a" in call.prompt))


def test_calibrate_asks_once_per_labelled_attempt_then_never_and_leaves_the_warehouse_alone(
    labelled, monkeypatch, capsys
):
    before = fingerprint(labelled / "warehouse")
    with FakeOpenAI(candidate) as server:
        monkeypatch.setenv("FILTER_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")  # production's; replaced below
        monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
        args = ["calibrate", "--data", str(labelled), "--model", "strict-model", "--base-url", server.base_url]
        assert main(args) == 0
        first = capsys.readouterr().out
        assert len(server.calls) == 3  # a, b and e: c's latest label is unsure
        assert main(args) == 0
        second = capsys.readouterr().out
        assert len(server.calls) == 3  # every verdict reused by cache key
    assert fingerprint(labelled / "warehouse") == before  # kept, surplus, verdicts, commits: untouched
    eval_file = labelled / "warehouse" / "judge_eval" / "strict-model_v3_votes1.parquet"
    verdicts = pd.read_parquet(eval_file).set_index("dir")
    assert verdicts.loc[["runs/r/traj/a/1", "runs/r/traj/b/1", "runs/r/traj/e/1"], "passed"].tolist() == [
        True,
        False,
        False,
    ]
    assert verdicts["model"].unique().tolist() == ["strict-model"]
    assert "judging 3 labelled attempts" in first and "asked 3 requests now" in first
    assert "asked 0 requests now" in second
    # production judged a and b and passed both (precision 1/2, on 2 labels); the candidate passes a only
    # (precision 1/1): on those same 2 labels, and on 3 with e, the failed attempt production never judged
    lines = {line.split(": ")[0] + ": " + line.split(": ")[1]: line for line in second.splitlines() if ": " in line}
    assert lines["production: judge judge-test v3"].startswith(
        "production: judge judge-test v3: precision 0.50 [0.09, 0.91], recall 1.00"
    )
    assert (
        lines["candidate strict-model_v3_votes1: judge strict-model v3"]
        .split(": ", 2)[2]
        .startswith("precision 1.00 [0.21, 1.00], recall 1.00 [0.21, 1.00], kappa 1.00 on 2 labels")
    )
    every = "candidate strict-model_v3_votes1 (every labelled attempt, 1 of them never judged in production)"
    assert (
        lines[f"{every}: judge strict-model v3"]
        .split(": ", 2)[2]
        .startswith("precision 1.00 [0.21, 1.00], recall 1.00 [0.21, 1.00], kappa 1.00 on 3 labels")
    )
    assert "2 requests" in lines["production: judge judge-test v3"]  # what production paid for those attempts


def test_a_calibration_on_fewer_labels_keeps_the_other_verdicts_on_file_and_pays_for_none_again(
    labelled, monkeypatch, capsys
):
    monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
    labels = labelled / "labels.jsonl"
    eval_file = labelled / "warehouse" / "judge_eval" / "strict-model_v3_votes1.parquet"
    on_file = lambda: sorted(pd.read_parquet(eval_file)["dir"])  # noqa: E731
    with FakeOpenAI(candidate) as server:
        args = ["calibrate", "--data", str(labelled), "--model", "strict-model", "--base-url", server.base_url]
        assert main(args) == 0 and len(server.calls) == 3
        everything = labels.read_text()
        labels.write_text(everything.splitlines(keepends=True)[0])  # a alone
        assert main(args) == 0 and len(server.calls) == 3
        assert on_file() == ["runs/r/traj/a/1", "runs/r/traj/b/1", "runs/r/traj/e/1"]
        labels.write_text("not a label\n")
        assert main(args) == 2
        assert on_file() == ["runs/r/traj/a/1", "runs/r/traj/b/1", "runs/r/traj/e/1"]
        labels.write_text(everything)
        assert main(args) == 0 and len(server.calls) == 3
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "filter-pipeline: warning: labels.jsonl:1: not JSON (Expecting value at column 1)",
        f"filter-pipeline: {labelled}: labels.jsonl holds no label (1 line(s) refused, above): label some attempts",
    ]


def test_verdicts_are_priced_once_where_two_runs_name_the_same_dirs(labelled, monkeypatch, capsys):
    shutil.copytree(labelled / "runs" / "r1", labelled / "runs" / "r1-copy")  # (cp -r: the dirs still say runs/r/)
    with dg.DagsterInstance.ephemeral() as instance, FakeOpenAI() as production:
        Pipeline(labelled, instance).run(llm(production, price_per_million_prompt_tokens=1.0), run_id="r1-copy")
    monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
    with FakeOpenAI(candidate) as server:
        assert main(["calibrate", "--data", str(labelled), "--model", "strict", "--base-url", server.base_url]) == 0
    out = capsys.readouterr().out
    assert "asked 6 requests now" in out  # a, b and e of each run
    same, every = [line for line in out.splitlines() if line.startswith("candidate strict_v3_votes1")]
    assert "; 4 requests, " in same  # a and b of each run: the attempts production judged
    assert "; 6 requests, " in every  # each verdict once, however many labelled attempts share its dir


def test_each_production_judge_is_priced_on_its_own_verdicts(labelled, monkeypatch, capsys):
    tasks = [task("g"), task("h", site="s2")]
    write_batch(labelled, "r2", tasks, [attempt(t["task_id"], dir=f"runs/r2/traj/{t['task_id']}/1") for t in tasks])
    with dg.DagsterInstance.ephemeral() as instance:
        Pipeline(labelled, instance).run(JudgeResource(kind="gate"), run_id="r2")
    with open(labelled / "labels.jsonl", "a") as f:
        f.write(json.dumps({"dir": "runs/r2/traj/g/1", "success": True}) + "\n")
    monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
    with FakeOpenAI(candidate) as server:
        assert main(["calibrate", "--data", str(labelled), "--model", "strict", "--base-url", server.base_url]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("production: judge")]
    assert [line.split(": precision")[0] for line in lines] == [
        "production: judge (the gate judge: no model)",
        "production: judge judge-test v3",
    ]
    assert lines[0].endswith("; 0 requests, 0 tokens, not priced")
    assert "; 2 requests, " in lines[1] and "not priced" not in lines[1]


def test_calibrate_against_an_endpoint_that_refuses_is_exit_1_with_one_line_and_writes_nothing(
    labelled, monkeypatch, capsys
):
    before = fingerprint(labelled / "warehouse")
    refusing = Reply(status=401, body=error_body("Incorrect API key provided", code="invalid_api_key"))
    with FakeOpenAI(lambda call, n: refusing) as server:
        monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
        assert main(["calibrate", "--data", str(labelled), "--base-url", server.base_url]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"filter-pipeline: the judge endpoint {server.base_url}/chat/completions refused"), err
    assert "HTTP 401: Incorrect API key provided (check FILTER_JUDGE_API_KEY)" in err
    assert fingerprint(labelled / "warehouse") == before
    assert not (labelled / "warehouse" / "judge_eval").exists()


def test_calibrate_with_attempts_left_unjudged_is_exit_3_and_a_rerun_asks_for_those_alone(
    labelled, monkeypatch, capsys
):
    monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
    monkeypatch.setenv("FILTER_JUDGE_TASK_BUDGET", "0.5")
    down = lambda call, n: Reply(status=503, body="down") if "do a" in call.prompt else candidate(call, n)  # noqa: E731
    with FakeOpenAI(down) as server:
        assert main(["calibrate", "--data", str(labelled), "--base-url", server.base_url]) == 3
    err = capsys.readouterr().err
    assert "the candidate left 1 of 3 labelled attempts unjudged" in err and len(err.strip().splitlines()) == 1
    with FakeOpenAI(candidate) as healthy:
        assert main(["calibrate", "--data", str(labelled), "--base-url", healthy.base_url]) == 0
        assert len(healthy.calls) == 1  # a alone


def test_calibrate_without_labels_or_endpoint_says_so_in_one_line(data_root, monkeypatch, capsys):
    assert main(["calibrate", "--data", str(data_root / "nope")]) == 2
    assert (
        capsys.readouterr().err
        == f"filter-pipeline: --data {data_root / 'nope'}: no such folder (point --data or FILTER_PIPELINE_DATA at "
        "the folder that holds runs/)\n"
    )
    assert main(["calibrate", "--data", str(data_root)]) == 2
    assert capsys.readouterr().err.startswith(f"filter-pipeline: {data_root}: no labels.jsonl")
    (data_root / "labels.jsonl").mkdir()
    assert main(["calibrate", "--data", str(data_root)]) == 2
    err = capsys.readouterr().err
    assert err == f"filter-pipeline: {data_root}: labels.jsonl cannot be read (Is a directory)\n"
    (data_root / "labels.jsonl").rmdir()
    sample_batch(data_root)
    (data_root / "labels.jsonl").write_text('{"dir": "runs/r/traj/a/1", "success": true}\n')
    (data_root / "warehouse" / "judge_verdicts").mkdir(parents=True)
    monkeypatch.delenv("FILTER_JUDGE_MODEL", raising=False)
    monkeypatch.delenv("FILTER_JUDGE_BASE_URL", raising=False)
    assert main(["calibrate", "--data", str(data_root)]) == 2
    assert capsys.readouterr().err == (
        "filter-pipeline: the candidate judge needs --base-url and --model (or FILTER_JUDGE_BASE_URL and "
        "FILTER_JUDGE_MODEL)\n"
    )
    assert main(["calibrate", "--data", str(data_root), "--model", "m"]) == 2
    assert "the candidate judge needs --base-url (or FILTER_JUDGE_BASE_URL)" in capsys.readouterr().err


def test_labels_that_name_no_attempt_of_the_warehouse_are_exit_2_and_nothing_is_asked_or_written(labelled, capsys):
    (labelled / "labels.jsonl").write_text(
        '{"dir": "runs/other/traj/a/1", "success": true}\n{"dir": "runs/r/traj/a/1", "success": null}\n'
    )
    before = sorted(labelled.rglob("*"))
    with FakeOpenAI(candidate) as server:
        status = main(["calibrate", "--data", str(labelled), "--base-url", server.base_url, "--model", "cand"])
        assert server.calls == []
    assert status == 2
    assert capsys.readouterr().err == (
        f"filter-pipeline: {labelled}: none of the 2 label(s) in labels.jsonl is a sure label (success true or "
        "false) of an attempt in the warehouse's batch_attempts: nothing to judge\n"
    )
    assert sorted(labelled.rglob("*")) == before  # no candidate's file, not even an empty one


@pytest.mark.slow
def test_materialize_naming_no_run_refreshes_judge_calibration_when_labels_changed(cli, data_root, tmp_path):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    first = cli()
    assert first.returncode == 0, first.stderr
    assert "labels.jsonl changed" not in first.stdout
    assert first.stdout.splitlines()[-1].startswith("coverage: ")  # (no labels.jsonl: no calibration to speak of)
    (data_root / "labels.jsonl").write_text(
        '{"run_id": "r1", "task_id": "a", "success": true}\n{"run_id": "r1", "task_id": "b", "success": false}\n'
    )
    refreshed = cli()
    assert refreshed.returncode == 0, refreshed.stderr
    assert "nothing to materialize" in refreshed.stdout
    assert "labels.jsonl changed since judge_calibration was built: refreshing it" in refreshed.stdout
    assert "judge_calibration: gate: precision 0.50 [0.09, 0.91], recall 1.00" in refreshed.stdout
    again = cli()  # up to date now: nothing run
    assert again.returncode == 0 and "refreshing" not in again.stdout
    table = pd.read_parquet(data_root / "warehouse" / "judge_calibration.parquet")
    assert table[table["site"] == "(all)"]["n"].tolist() == [2, 2]
    fresh = tmp_path / "another_instance"  # (a laptop's instance, say, on the same data root)
    fresh.mkdir()
    built = cli(env={"DAGSTER_HOME": str(fresh)})
    assert built.returncode == 0 and "labels.jsonl changed" not in built.stdout
    assert "judge_calibration has no record of the labels.jsonl it was built from on this instance: building it" in (
        built.stdout
    )


@pytest.mark.slow
def test_labels_of_which_none_counts_are_said_so_in_the_summary(cli, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    (data_root / "labels.jsonl").write_text('{"run_id": "r9", "task_id": "a", "success": true}\n')  # (no such run)
    done = cli()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "judge_calibration: no label of labels.jsonl counts yet (unreadable, or no success or failure label of a "
        "judged attempt in it; the step's warnings name the lines it could not use)"
    )
    assert "labels.jsonl:1: names no attempt of a parsed batch (run_id 'r9', task_id 'a')" in done.stderr


@pytest.mark.slow
def test_a_calibration_refresh_with_the_data_root_given_by_argument_writes_there(cli_env, data_root, tmp_path):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    env = {k: v for k, v in cli_env.items() if k != "FILTER_PIPELINE_DATA"}
    elsewhere = tmp_path / "elsewhere"  # the working directory, whose ./data is not the data root
    elsewhere.mkdir()
    run = lambda: subprocess.run([*CLI, "materialize", "--data", str(data_root)], env=env, cwd=elsewhere,  # noqa: E731
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run().returncode == 0
    (data_root / "labels.jsonl").write_text('{"run_id": "r1", "task_id": "a", "success": false}\n')
    refreshed = run()
    assert refreshed.returncode == 0 and "refreshing it" in refreshed.stdout, refreshed.stderr
    assert "judge_calibration: gate: precision 0.00" in refreshed.stdout
    table = pd.read_parquet(data_root / "warehouse" / "judge_calibration.parquet")
    assert table[table["site"] == "(all)"]["n"].tolist() == [1, 1]
    assert list(elsewhere.iterdir()) == [] and "refreshing" not in run().stdout


@pytest.mark.parametrize(
    "model, version, name",
    [("org/judge:7b", "v3", "org-judge-7b_v3_votes1"), ("../../x", "../y", "x_..-y_votes1")],
)
def test_a_candidates_file_name_is_plain_and_never_hidden(model, version, name):
    from filter_pipeline.cli.calibrate import candidate_name
    from filter_pipeline.judge.config import LLMJudgeConfig

    judge = JudgeResource(kind="llm", llm=LLMJudgeConfig(base_url="http://x", model=model, prompt_version=version))
    assert candidate_name(judge) == name


def test_a_task_label_scores_the_candidate_on_the_attempt_production_judged_only():
    from filter_pipeline.cli.calibrate import side_by_side
    from filter_pipeline.rules.calibration import parse_labels

    # task t: attempt 1 failed (labelled a failure by dir), attempt 2 judged by production (labelled by task);
    # a lenient candidate, asked about both, passes both: one of its two passes is wrong
    labels, _ = parse_labels('{"dir": "t1", "success": false}\n{"run_id": "r", "task_id": "t", "success": true}\n')
    tasks = pd.DataFrame({"run_id": ["r"], "task_id": ["t"], "site": ["s"]})
    attempts = pd.DataFrame({"run_id": ["r", "r"], "task_id": ["t", "t"], "dir": ["t1", "t2"], "ok": [False, True]})
    spend = {"requests": 1, "prompt_tokens": 0, "completion_tokens": 0, "cost": None}
    production = pd.DataFrame({"run_id": ["r"], "task_id": ["t"], "dir": ["t2"], "passed": [True],
                               "status": ["judged"], "model": ["m"], "prompt_version": ["v3"], **spend})  # fmt: skip
    candidate = pd.DataFrame({"run_id": ["r", "r"], "task_id": ["t", "t"], "dir": ["t1", "t2"], "passed": [True, True],
                              "status": ["judged"] * 2, "model": ["lenient"] * 2, "prompt_version": ["v3"] * 2,
                              **spend})  # fmt: skip
    every = [line for line in side_by_side(labels, (attempts, production, tasks), candidate, "c") if "every" in line]
    assert len(every) == 1 and ": precision 0.50 [0.09, 0.91], recall 1.00" in every[0] and "on 2 labels" in every[0]
