"""The judge resource inside the pipeline: LLM verdicts, faults, the verdict cache, agreement, secrets."""

import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.rate import PROBE_REQUESTS
from filter_pipeline.judge.resource import JudgeResource, judge_from_env
from filter_pipeline.rules.report import agreement
from filter_pipeline.rules.schemas import SCHEMAS
from filter_pipeline_tests.builders import Pipeline, attempt, rows, task, verdicts, write_batch
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply

PASS = '{"passed": true, "why": "done"}'
FAIL = '{"passed": false, "why": "wrong page"}'
CONTRACT = {
    "kept": ["task_id", "macro", "site", "dedup_key", "attempt", "dir", "passed", "why", "votes"],
    "surplus": ["task_id", "dropped", "dup_of_run_id", "dup_of_task_id", "votes"],
    "failure_pool": ["task_id", "stage", "reason", "detail", "attempt", "votes", "backend_ok"],
}


def model_that_fails(*failing: str, faults: bool = False):
    """A judge model failing the tasks named in `failing` (by instruction); with `faults`, its first six
    calls are 429s and 500s, so every vote that lands on one must be retried."""

    def responder(call, n):
        if faults and n < 6 and n % 2 == 0:
            return Reply(status=429, headers={"Retry-After": "0"}, body="{}")
        if faults and n < 6:
            return Reply(status=500, body="{}")
        return Reply(content=FAIL if any(f"do {t}" in call.prompt for t in failing) else PASS)

    return responder


def sample_batch(data_root: Path, run_id: str = "r1") -> None:
    tasks = [task("a", key=["k1"]), task("b", key=["k1"]), task("c", key=["k2"]), task("d", site="s2"), task("e")]
    attempts = [
        attempt("a"),
        attempt("b"),
        attempt("c"),
        attempt("d"),
        attempt("e", ok=False, error="action refused: x"),
    ]
    write_batch(data_root, run_id, tasks, attempts)


@pytest.fixture
def pipeline(data_root):
    with dg.DagsterInstance.ephemeral() as instance:
        yield Pipeline(data_root, instance)


def llm(server: FakeOpenAI, **kw) -> JudgeResource:
    """The LLM judge asking `server`, with the LLM settings `kw`."""
    return JudgeResource(kind="llm", llm=LLMJudgeConfig(**{"base_url": server.base_url, "model": "judge-test", **kw}))


def verdict_metadata(result) -> dict:
    [mat] = [m for m in result.get_asset_materialization_events() if m.asset_key.path[-1] == "judge_verdicts"]
    return {k: v.value for k, v in mat.materialization.metadata.items()}


def test_llm_verdicts_flow_through_the_same_rules_as_the_gate_even_under_faults(tmp_path):
    outputs = {}
    for name, faults in (("clean", False), ("faulty", True)):
        root = tmp_path / name
        sample_batch(root)
        with dg.DagsterInstance.ephemeral() as instance, FakeOpenAI(model_that_fails("c", faults=faults)) as server:
            Pipeline(root, instance).run(llm(server))
            assert len(server.calls) == (10 if faults else 4)  # one request per task, plus the six faults
            outputs[name] = {a: rows(Pipeline(root, instance).output(a), *cols) for a, cols in CONTRACT.items()}
    assert outputs["faulty"] == outputs["clean"]
    clean = outputs["clean"]
    assert [r[0] for r in clean["kept"]] == ["a", "d"]
    assert clean["surplus"] == [["b", "duplicate", "r1", "a", "1/1"]]
    assert clean["failure_pool"] == [
        ["e", "execute", "action_refused", "action refused: x", 1, None, False],
        ["c", "judge", "judge_fail", "wrong page", 1, "0/1", None],
    ]


def test_outage_leaves_tasks_unjudged_and_the_next_materialization_judges_only_those(pipeline):
    sample_batch(pipeline.data_root)
    with FakeOpenAI(
        lambda call, n: Reply(status=503, body="down") if "do a" in call.prompt else Reply(content=PASS)
    ) as server:
        first = pipeline.run(llm(server, task_budget_seconds=2.0))  # (outlasts the 503's back-off on a loaded machine)
    v = pipeline.output("judge_verdicts")
    assert rows(v, "task_id", "status") == [["a", "error"], ["b", "judged"], ["c", "judged"], ["d", "judged"]]
    assert "HTTP 503" in v.loc[v["task_id"] == "a", "why"].item()
    assert "a" not in set(pipeline.output("failure_pool")["task_id"])
    assert "a" not in set(pipeline.output("kept")["task_id"])
    assert verdict_metadata(first)["unjudged"] == 1

    with FakeOpenAI() as healthy:
        second = pipeline.run(llm(healthy))
        assert len(healthy.calls) == 1  # only task a
    assert verdict_metadata(second)["cache_hits"] == 3
    assert pipeline.output("kept")["task_id"].tolist() == ["a", "c", "d"]
    # a's row says what judging it cost, its unjudged tries included; the metadata what this materialization paid
    tried = int(v.loc[v["task_id"] == "a", "requests"].item())
    assert tried >= 1 and verdict_metadata(second)["requests"] == 1
    again = pipeline.output("judge_verdicts").set_index("task_id")
    assert again.loc["a", "requests"] == tried + 1 and again.loc["a", "status"] == "judged"
    assert (
        again.loc[["b", "c", "d"], "requests"].tolist()
        == v.set_index("task_id").loc[["b", "c", "d"], "requests"].tolist()
    )


def batch_files_written(data_root) -> dict[str, int]:
    """When each of the batch's files (batch_tasks, batch_attempts, batch_rejects) of r1 was last written."""
    return {
        a: (data_root / "warehouse" / a / "r1.parquet").stat().st_mtime_ns for a in SCHEMAS if a.startswith("batch_")
    }


def test_a_rejudging_by_another_judge_fails_in_one_line_and_keeps_the_verdicts_paid_for(pipeline):
    from filter_pipeline.shell.jobs import REJUDGE_OF_TAG
    from filter_pipeline.storage.history import read_commit

    sample_batch(pipeline.data_root)
    with FakeOpenAI(lambda call, n: Reply(status=503, body="down") if "do a" in call.prompt else Reply()) as server:
        # (a budget that outlasts the back-off a 503 makes every task take, on a loaded machine too)
        judge = llm(server, task_budget_seconds=2.0)
        pipeline.run(judge)
    assert rows(pipeline.output("judge_verdicts"), "task_id", "status")[0] == ["a", "error"]  # a left unjudged
    assert (pipeline.output("judge_verdicts")["status"] == "error").sum() == 1
    assert read_commit(UPath(pipeline.data_root) / "warehouse", "r1").judge == judge.identity()  # what is compared
    verdicts = (pipeline.data_root / "warehouse" / "judge_verdicts" / "r1.parquet").read_bytes()
    batch_files = batch_files_written(pipeline.data_root)
    for job_name, tags in (("rejudge_job", {}), ("filter_job", {REJUDGE_OF_TAG: "r1"})):  # the sensor's, the CLI's
        job = build_defs(str(pipeline.data_root), JudgeResource(kind="gate"), caps={}).resolve_job_def(job_name)
        result = job.execute_in_process(instance=pipeline.instance, partition_key="r1", tags=tags, raise_on_error=False)
        assert not result.success
        [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert failure.step_failure_data.user_failure_data.description == (
            "r1: its unjudged tasks are judged again only by the judge that judged the rest: the run was judged by "
            "llm judge-test v3 (votes 1), not by gate (set FILTER_JUDGE_* as they were)"
        )
        assert (pipeline.data_root / "warehouse" / "judge_verdicts" / "r1.parquet").read_bytes() == verdicts
        # (nor written before the line: the batch's files are those its verdicts were judged from)
        assert batch_files_written(pipeline.data_root) == batch_files
    with FakeOpenAI() as server:  # the judge that judged the rest, with more votes or warmer: another judge too
        for changed in ({"votes": 3}, {"temperature": 0.7}):
            job = build_defs(str(pipeline.data_root), llm(server, **changed), caps={}).resolve_job_def("rejudge_job")
            result = job.execute_in_process(instance=pipeline.instance, partition_key="r1", raise_on_error=False)
            assert not result.success
        assert server.calls == []
        job = build_defs(str(pipeline.data_root), llm(server), caps={}).resolve_job_def("rejudge_job")
        assert job.execute_in_process(instance=pipeline.instance, partition_key="r1").success
        assert ["do a" in call.prompt for call in server.calls] == [True]  # the unjudged task alone


def test_a_refusing_endpoint_fails_the_step_in_one_line_after_the_probe_requests(pipeline):
    sample_batch(pipeline.data_root)
    pipeline.instance.add_dynamic_partitions("run_id", ["r1"])
    with FakeOpenAI(lambda call, n: Reply(status=401, body='{"error": {"message": "bad key sk-SECRET-1"}}')) as server:
        job = build_defs(
            str(pipeline.data_root), llm(server, api_key="sk-SECRET-1", concurrency=64), caps={}
        ).resolve_job_def("filter_job")
        result = job.execute_in_process(instance=pipeline.instance, partition_key="r1", raise_on_error=False)
    assert not result.success and len(server.calls) <= PROBE_REQUESTS
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = str(failure.step_failure_data.error.to_string())
    assert (
        f"the judge endpoint {server.base_url}/chat/completions refused the request" in message
        and "HTTP 401" in message
    )
    assert "sk-SECRET-1" not in message
    assert not (pipeline.data_root / "warehouse" / "kept" / "r1.parquet").exists()


def test_rematerializing_costs_zero_calls_and_a_new_prompt_version_pays_again(pipeline):
    sample_batch(pipeline.data_root)
    with FakeOpenAI() as server:
        pipeline.run(llm(server), judging_only=True)
        assert len(server.calls) == 4
        again = pipeline.run(llm(server), judging_only=True)
        assert len(server.calls) == 4
        meta = verdict_metadata(again)
        assert (meta["requests"], meta["cache_hits"]) == (0, 4)
        assert pipeline.output("judge_verdicts")["cached"].tolist() == [True] * 4
        pipeline.run(llm(server, prompt_version="v2"), judging_only=True)
        assert len(server.calls) == 8
        pipeline.run(llm(server, model="other-model"), judging_only=True)
        assert len(server.calls) == 12


def test_verdict_records_and_metadata(pipeline):
    sample_batch(pipeline.data_root)
    with FakeOpenAI(model_that_fails("c")) as server:
        result = pipeline.run(llm(server))
    v = pipeline.output("judge_verdicts").set_index("task_id")
    assert v.loc["a", ["judge", "model", "prompt_version", "status", "votes"]].tolist() == [
        "llm",
        "judge-test",
        "v3",
        "judged",
        "1/1",
    ]
    assert v.loc["a", "prompt_tokens"] == 100 and v.loc["a", "completion_tokens"] == 10
    assert json.loads(v.loc["c", "raw_replies"]) == [FAIL]
    assert len(v.loc["a", "cache_key"]) == 64
    meta = verdict_metadata(result)
    assert (meta["requests"], meta["prompt_tokens"], meta["unjudged"]) == (4, 400, 0)
    assert meta["pass_rate"] == 0.75
    assert meta["latency_p95_ms"] >= meta["latency_p50_ms"] > 0
    assert "| s2 | 1 | 1 | 100% |" in meta["agreement_with_gate"]


def test_agreement_is_the_judge_pass_rate_per_site_and_macro():
    v = verdicts(
        {"task_id": "a", "site": "s1", "passed": True},
        {"task_id": "b", "site": "s1", "passed": False},
        {"task_id": "c", "site": "s2", "passed": True},
        {"task_id": "d", "site": "s2", "passed": None, "status": "error"},
    )
    assert agreement(v, "site").values.tolist() == [["s1", 2, 1, 0.5], ["s2", 1, 1, 1.0]]


def test_settings_come_from_the_environment_and_bad_values_say_which(monkeypatch):
    monkeypatch.setenv("FILTER_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("FILTER_JUDGE_MODEL", "m")
    monkeypatch.setenv("FILTER_JUDGE_VOTES", "5")
    monkeypatch.setenv("FILTER_JUDGE_API_KEY", "sk-env")
    judge = judge_from_env("llm")
    assert (judge.llm.votes, judge.llm.model) == (5, "m")
    assert isinstance(judge.llm.api_key, dg.EnvVar)  # Dagster shows the variable's name, not its value
    asked_directly = judge_from_env("llm", env_vars=False).llm  # (a process that asks the endpoint itself)
    assert (asked_directly.base_url, asked_directly.api_key) == ("http://127.0.0.1:9/v1", "sk-env")
    monkeypatch.setenv("FILTER_JUDGE_VOTES", "three")
    with pytest.raises(ValueError, match="FILTER_JUDGE_VOTES='three' is not a valid int"):
        judge_from_env("llm")


def test_a_base_url_from_the_environment_is_shown_by_its_variable_never_its_text(monkeypatch):
    # a gateway that takes the key in the path: nothing tells it from a plain path
    monkeypatch.setenv("FILTER_JUDGE_BASE_URL", "https://gateway.example/k/sk-PATH-SECRET/v1")
    monkeypatch.setenv("FILTER_JUDGE_MODEL", "m")
    judge = judge_from_env("llm")
    assert isinstance(judge.llm.base_url, dg.EnvVar)
    assert "sk-PATH-SECRET" not in judge.model_dump_json()  # what the UI's resource config is made of
    monkeypatch.setenv("FILTER_JUDGE_BASE_URL", "ftp://gateway.example/k/sk-PATH-SECRET")
    with pytest.raises(ValueError, match=r"FILTER_JUDGE_BASE_URL is not an http\(s\) URL") as refused:
        judge.settings()  # (the variable's value is checked, as it is read)
    assert "sk-PATH-SECRET" not in str(refused.value)


def test_llm_judge_without_endpoint_settings_is_refused():
    with pytest.raises(ValueError, match="FILTER_JUDGE_BASE_URL and FILTER_JUDGE_MODEL"):
        JudgeResource(kind="llm").settings()


@pytest.mark.slow
def test_cli_llm_judge_never_leaks_the_api_key(cli, data_root, dagster_home):
    secret = "sk-live-SECRET-4242"
    sample_batch(data_root)

    def responder(call, n):
        if "do a" in call.prompt:  # an endpoint that echoes the credential back in an error
            return Reply(status=400, body=f'{{"error": "bad request for key {secret}"}}')
        return Reply(content=PASS)

    with FakeOpenAI(responder) as server:
        done = cli(
            "--judge", "llm",
            env={"FILTER_JUDGE_BASE_URL": server.base_url, "FILTER_JUDGE_MODEL": "judge-test",
                 "FILTER_JUDGE_API_KEY": secret, "FILTER_JUDGE_VOTES": "1"},
        )  # fmt: skip
    assert done.returncode == 3, done.stderr  # task a is left unjudged by its 400: judged again later
    assert server.calls[0].headers["Authorization"] == f"Bearer {secret}"
    assert secret not in done.stdout + done.stderr
    for folder in (data_root / "warehouse", dagster_home):
        for path in folder.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
    why = pd.read_parquet(data_root / "warehouse" / "judge_verdicts" / "r1.parquet")["why"].tolist()
    assert any("***" in w for w in why)


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_on_s3_the_llm_judge_reads_each_attempts_trajectory_from_the_bucket(s3_bucket):
    from filter_pipeline.shell.warehouse import DataRoot

    root = DataRoot(path=f"s3://{s3_bucket}/data").root
    write_batch(
        root, "r1", [task("a"), task("b")], [attempt("a", dir="runs/r1/traj/a/1"), attempt("b", dir="runs/r1/traj/b/1")]
    )
    trajectory = {
        "steps": [{"action": "type", "text": "blue shoes"}],
        "final": {"url": "https://shop/a", "observation": "Order 77 placed"},
    }
    (root / "runs/r1/traj/a/1/trajectory.json").write_text(json.dumps(trajectory))  # b has none: its record's steps

    with dg.DagsterInstance.ephemeral() as instance, FakeOpenAI(model_that_fails("b")) as server:
        Pipeline(str(root), instance).run(llm(server, votes=1))
        prompts = {("a" if "do a" in c.prompt else "b"): c.prompt for c in server.calls}
    assert "Order 77 placed" in prompts["a"] and "blue shoes" in prompts["a"]
    assert '"action": "click"' in prompts["b"] and "(no page text)" in prompts["b"]
    kept = pd.read_parquet(f"s3://{s3_bucket}/data/warehouse/kept/r1.parquet")
    assert kept["task_id"].tolist() == ["a"]
    assert list((root / "warehouse" / "_judge_progress").rglob("*.parquet")) == []  # saved, then dropped once written
