"""Every bad argument, setting or input gets one line and the right exit status, and nothing else is lost.

Refusals (exit 2) are checked in-process through `cli.main.main`: they stop before any run starts. What
needs a run (a failed step, a refused folder, bad records, bad labels) runs the CLI as a user does (slow).
"""

import json

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.cli.main import main
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.servers import free_port

SURROGATE = "\\ud800"


@pytest.fixture
def env(monkeypatch, dagster_home, data_root):
    """The user's shell: DAGSTER_HOME and the data root set, no other filter-pipeline setting."""
    for name in ("FILTER_PIPELINE_CAPS", "FILTER_PIPELINE_EXECUTOR", "FILTER_JUDGE_KIND", "FILTER_JUDGE_VOTES",
                 "FILTER_JUDGE_BASE_URL", "FILTER_JUDGE_MODEL", "FILTER_JUDGE_API_KEY",
                 "FILTER_PIPELINE_ENDPOINT_URL"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    monkeypatch.setenv("FILTER_PIPELINE_DATA", str(data_root))
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    return monkeypatch


def refused(capsys, *argv) -> str:
    """Run the CLI, expecting exit status 2 with exactly one line on stderr and nothing on stdout; the line."""
    try:
        status = main(["materialize", *argv])
    except SystemExit as exc:  # argparse
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err.strip()


def nothing_registered_or_written(dagster_home, data_root) -> None:
    assert not (data_root / "warehouse").exists()
    assert not list(dagster_home.glob("storage/*")) or _no_partitions(dagster_home)


def _no_partitions(dagster_home) -> bool:
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        return instance.get_dynamic_partitions("run_id") == [] and not instance.get_run_records()


@pytest.mark.parametrize(
    "text, field",
    [
        ('per_site_cap: "2"\n', 'per_site_cap: Input should be a valid integer (got "2")'),
        ("per_site_cap: 2.0\n", "per_site_cap: Input should be a valid integer (got 2.0)"),
        ("per_site_cap: true\n", "per_site_cap: Input should be a valid integer (got true)"),
        ('caps: {m: {site_cap: "1"}}\n', 'caps.m.site_cap: Input should be a valid integer (got "1")'),
        ("caps: {m: {target: 2.5}}\n", "caps.m.target: Input should be a valid integer (got 2.5)"),
        ("caps: {m: {target: false}}\n", "caps.m.target: Input should be a valid integer (got false)"),
        ("caps: [m]\n", "caps must be a mapping"),
        ("caps: {7: {site_cap: 1}}\n", "caps: macro name 7 must be a string"),
        ("per_site_cap: 100000000000000000000\n", "per_site_cap: must be at most"),
    ],
)
def test_a_caps_value_that_is_not_a_plain_integer_is_refused_in_one_line_before_anything_is_registered(
    env, capsys, tmp_path, dagster_home, data_root, text, field
):
    caps = tmp_path / "caps.yaml"
    caps.write_text(text)
    assert refused(capsys, "--caps", str(caps)).startswith(f"filter-pipeline: caps file {caps}: {field}")
    nothing_registered_or_written(dagster_home, data_root)


@pytest.mark.parametrize(
    "name, text, line",
    [
        (
            "caps.yaml",
            "per_site_cap: 2\ncaps:\n  m: {site_cap: 1\n",
            "caps.yaml:4:1: not YAML or JSON: while parsing a flow mapping expected ',' or '}', but got '<stream end>'",
        ),
        ("caps.yaml", "per_site_cap: 2\nper_site_cap: 3\n", 'caps.yaml:2:1: key "per_site_cap" appears twice'),
        ("caps.yaml", "caps:\n  m: {site_cap: 1}\n  m: {target: 2}\n", 'caps.yaml:3:3: key "m" appears twice'),
        (
            "caps.json",
            '{\n\t"per_site_cap": 2,\n}\n',
            "caps.json:3:1: not JSON: Expecting property name enclosed in double quotes",
        ),
        ("caps.json", '{"caps": {"m": {"site_cap": 1}, "m": {}}}', 'caps.json: key "m" appears twice'),
    ],
)
def test_a_caps_file_that_does_not_parse_is_one_line_with_its_line_and_column(
    env, capsys, tmp_path, dagster_home, data_root, name, text, line
):
    caps = tmp_path / name
    caps.write_text(text)
    assert refused(capsys, "--caps", str(caps)) == f"filter-pipeline: caps file {tmp_path}/{line}"
    nothing_registered_or_written(dagster_home, data_root)


def test_a_json_caps_file_indented_with_tabs_is_read(env, tmp_path):
    from filter_pipeline.shell.config import load_caps_file

    caps = tmp_path / "caps.json"
    caps.write_text('{\n\t"per_site_cap": 2,\n\t"caps": {"m": {"target": 4}}\n}\n')
    assert load_caps_file(caps) == {"per_site_cap": 2, "caps": {"m": {"target": 4}}}


def test_bad_caps_in_the_environment_are_refused_naming_the_variable(env, capsys, tmp_path, dagster_home, data_root):
    caps = tmp_path / "caps.yaml"
    caps.write_text("per_site_cap: '2'\n")
    env.setenv("FILTER_PIPELINE_CAPS", str(caps))
    assert (
        refused(capsys)
        == f'filter-pipeline: FILTER_PIPELINE_CAPS: caps file {caps}: per_site_cap: Input should be a valid integer (got "2")'
    )
    nothing_registered_or_written(dagster_home, data_root)


@pytest.mark.parametrize("value", ["2.0", "two", "true"])
def test_a_per_site_cap_flag_that_is_not_an_integer_is_one_line(env, capsys, dagster_home, data_root, value):
    line = refused(capsys, "--per-site-cap", value)
    assert (
        line
        == f"filter-pipeline materialize: argument --per-site-cap: invalid int value: '{value}' (see filter-pipeline materialize --help)"
    )
    nothing_registered_or_written(dagster_home, data_root)


def test_a_data_root_that_does_not_exist_or_has_no_runs_folder_is_one_line(env, capsys, tmp_path, dagster_home):
    assert refused(capsys, "--data", str(tmp_path / "nope")) == (
        f"filter-pipeline: --data {tmp_path / 'nope'}: no such folder (point --data or FILTER_PIPELINE_DATA at the folder that holds runs/)"
    )
    env.setenv("FILTER_PIPELINE_DATA", str(tmp_path / "gone"))
    assert refused(capsys).startswith(f"filter-pipeline: FILTER_PIPELINE_DATA={tmp_path / 'gone'}: no such folder")
    (tmp_path / "empty").mkdir()
    assert refused(capsys, "--data", str(tmp_path / "empty")) == (
        f"filter-pipeline: --data {tmp_path / 'empty'}: has no runs/ folder, so it holds no execution batch (runs/<run_id>/); is it the data root?"
    )
    (tmp_path / "notes.txt").write_text("not a data root")
    assert refused(capsys, "--data", str(tmp_path / "notes.txt")) == (
        f"filter-pipeline: --data {tmp_path / 'notes.txt'}: is a file, not a folder (point --data or FILTER_PIPELINE_DATA at the folder that holds runs/)"
    )
    assert _no_partitions(dagster_home)


def test_a_retired_json_that_cannot_be_read_is_one_line_before_anything_is_registered(
    env, capsys, dagster_home, data_root
):
    (data_root / "retired.json").mkdir()
    assert refused(capsys) == "filter-pipeline: retired.json cannot be read (Is a directory)"
    nothing_registered_or_written(dagster_home, data_root)


def test_a_data_root_that_cannot_be_read_is_one_line_before_anything_is_registered(
    env, capsys, dagster_home, data_root
):
    def unreadable(runs, *args, **kwargs):  # what listing a folder without read permission raises
        raise PermissionError(13, "Permission denied", str(runs))

    env.setattr("filter_pipeline.cli.materialize.complete_batches", unreadable)
    assert refused(capsys) == (
        f"filter-pipeline: cannot read the data root {data_root}: Permission denied: {data_root / 'runs'}"
    )
    nothing_registered_or_written(dagster_home, data_root)


def test_a_dagster_home_that_is_unset_relative_or_missing_is_one_line(env, capsys, tmp_path, data_root):
    env.delenv("DAGSTER_HOME")
    assert refused(capsys).startswith("filter-pipeline: DAGSTER_HOME is not set")
    env.setenv("DAGSTER_HOME", "relative/home")
    assert refused(capsys).startswith("filter-pipeline: DAGSTER_HOME=relative/home: not an absolute path")
    env.setenv("DAGSTER_HOME", str(tmp_path / "missing"))
    assert refused(capsys) == (
        f"filter-pipeline: DAGSTER_HOME={tmp_path / 'missing'}: no such folder: point DAGSTER_HOME at the instance "
        f"folder, or create it with this project's settings (mkdir -p {tmp_path / 'missing'} && cp "
        f"instance/dagster.yaml {tmp_path / 'missing'}/)"
    )
    assert not (tmp_path / "missing").exists() and not (data_root / "warehouse").exists()


def test_a_dagster_yaml_that_is_not_valid_is_one_line(env, capsys, dagster_home, data_root):
    (dagster_home / "dagster.yaml").write_text("run_storage: {module: nowhere, class: Nothing}\n")
    assert refused(capsys).startswith(f"filter-pipeline: DAGSTER_HOME={dagster_home}: the instance cannot be loaded: ")
    assert not (data_root / "warehouse").exists()


@pytest.mark.parametrize(
    "name, value, line",
    [
        ("FILTER_JUDGE_VOTES", "x", "FILTER_JUDGE_VOTES='x' is not a valid int"),
        ("FILTER_JUDGE_KIND", "bogus", "FILTER_JUDGE_KIND='bogus': judge kind 'bogus' is not one of gate, llm"),
        ("FILTER_JUDGE_SCREENSHOT", "maybe", "FILTER_JUDGE_SCREENSHOT='maybe' is not a valid flag (true/false)"),
        (
            "FILTER_PIPELINE_EXECUTOR",
            "threads",
            "FILTER_PIPELINE_EXECUTOR='threads': expected one of in_process, multiprocess",
        ),
        (
            "FILTER_PIPELINE_LEASE_SECONDS",
            "x",
            "FILTER_PIPELINE_LEASE_SECONDS='x': expected a whole number of 0 or more",
        ),
        (
            "FILTER_PIPELINE_ORDER_RETRY_SECONDS",
            "-5",
            "FILTER_PIPELINE_ORDER_RETRY_SECONDS='-5': expected a whole number of 0 or more",
        ),
        (
            "FILTER_PIPELINE_REJUDGE_MAX_TRIES",
            "2.5",
            "FILTER_PIPELINE_REJUDGE_MAX_TRIES='2.5': expected a whole number of 0 or more",
        ),
        (
            "FILTER_PIPELINE_ENDPOINT_URL",
            "http://127.0.0.1:9",
            "an endpoint URL (FILTER_PIPELINE_ENDPOINT_URL, or the data resource's endpoint_url) applies to an "
            "s3:// data root, not file://",
        ),
    ],
)
def test_a_bad_setting_in_the_environment_is_one_line(env, capsys, dagster_home, data_root, name, value, line):
    env.setenv(name, value)
    assert refused(capsys) == f"filter-pipeline: {line}"
    nothing_registered_or_written(dagster_home, data_root)


@pytest.mark.parametrize(
    "argv", [["verify"], ["explain", "b1", "a"], ["review", "--port", "1"], ["calibrate"]], ids=lambda a: a[0]
)
def test_an_endpoint_url_for_a_local_data_root_is_refused_by_every_command_in_one_line(env, capsys, argv):
    env.setenv("FILTER_PIPELINE_ENDPOINT_URL", "http://127.0.0.1:9")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        "filter-pipeline: an endpoint URL (FILTER_PIPELINE_ENDPOINT_URL, or the data resource's endpoint_url) "
        "applies to an s3:// data root, not file://\n",
    )


@pytest.mark.parametrize(
    "argv", [["materialize"], ["verify"], ["explain", "b1", "a"], ["review", "--port", "1"], ["calibrate"]],
    ids=lambda a: a[0],
)  # fmt: skip
def test_an_object_store_that_cannot_be_reached_is_one_line_for_every_command(env, capsys, argv):
    # nothing listens on the port: the store refuses the connection (asked once, not after botocore's retries)
    env.setenv("FILTER_PIPELINE_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    for name, value in {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret-never-shown",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}.items():  # fmt: skip
        env.setenv(name, value)
    assert main([*argv, "--data", "s3://bucket/filter"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "secret-never-shown" not in err
    assert err.startswith(
        "filter-pipeline: --data s3://bucket/filter: cannot be read (EndpointConnectionError: Could not connect"
    )


@pytest.mark.parametrize(
    "name, value, line",
    [
        ("FILTER_JUDGE_CONCURRENCY", "0", "judge concurrency=0 (FILTER_JUDGE_CONCURRENCY): at least 1"),
        ("FILTER_JUDGE_VOTES", "0", "judge votes=0 (FILTER_JUDGE_VOTES): at least 1"),
        ("FILTER_JUDGE_TIMEOUT", "0", "judge timeout_seconds=0.0 (FILTER_JUDGE_TIMEOUT): must be above 0"),
        ("FILTER_JUDGE_MAX_TOKENS", "-1", "judge max_tokens=-1 (FILTER_JUDGE_MAX_TOKENS): 0 (not sent) or more"),
        ("FILTER_JUDGE_TEMPERATURE", "nan", "judge temperature=nan (FILTER_JUDGE_TEMPERATURE): a number, 0 or more"),
        ("FILTER_JUDGE_TEMPERATURE", "-inf", "judge temperature=-inf (FILTER_JUDGE_TEMPERATURE): a number, 0 or more"),
        ("FILTER_JUDGE_TEMPERATURE", "-0.5", "judge temperature=-0.5 (FILTER_JUDGE_TEMPERATURE): a number, 0 or more"),
    ],
)
def test_an_llm_judge_setting_out_of_range_is_one_line_naming_its_variable(
    env, capsys, dagster_home, data_root, name, value, line
):
    env.setenv("FILTER_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    env.setenv("FILTER_JUDGE_MODEL", "m")
    env.setenv(name, value)
    assert refused(capsys, "--judge", "llm") == f"filter-pipeline: {line}"
    nothing_registered_or_written(dagster_home, data_root)


@pytest.mark.parametrize("value, why", [("0", "0: at least 1"), ("two", "'two' is not a whole number")])
def test_calibrate_votes_below_one_is_refused_by_its_flag(env, capsys, value, why):
    with pytest.raises(SystemExit) as exited:
        main(["calibrate", "--votes", value])
    assert exited.value.code == 2
    assert f"argument --votes: {why}" in capsys.readouterr().err


def test_the_llm_judge_without_its_endpoint_is_one_line_before_anything_is_registered(
    env, capsys, dagster_home, data_root
):
    assert (
        refused(capsys, "--judge", "llm")
        == "filter-pipeline: the llm judge needs FILTER_JUDGE_BASE_URL and FILTER_JUDGE_MODEL"
    )
    nothing_registered_or_written(dagster_home, data_root)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("notaurl", "no scheme"),
        ("sk-proj-pasted-by-mistake", "no scheme"),
        ("ftp://127.0.0.1/v1", "scheme 'ftp'"),
        (
            "http://127.0.0.1:port/v1",
            "a port that is not a number from 1 to 65535, or an unclosed [ around an IPv6 host",
        ),
        ("http://[::1/v1", "a port that is not a number from 1 to 65535, or an unclosed [ around an IPv6 host"),
        ("http://user:s3cret@/v1", "no host"),
        (" http://127.0.0.1:8000/v1", "whitespace around it or a control character in it"),
    ],
)
def test_a_judge_base_url_no_request_can_reach_is_one_line_naming_the_problem_not_the_url(
    env, capsys, dagster_home, data_root, url, problem
):
    env.setenv("FILTER_JUDGE_BASE_URL", url)
    env.setenv("FILTER_JUDGE_MODEL", "m")
    assert refused(capsys, "--judge", "llm") == (
        f"filter-pipeline: FILTER_JUDGE_BASE_URL is not an http(s) URL such as http://127.0.0.1:8000/v1 ({problem})"
    )
    nothing_registered_or_written(dagster_home, data_root)


@pytest.mark.parametrize("key", ["sk-secret-value\n", " sk-secret-value", "sk-secret\rvalue"])
def test_an_api_key_a_header_cannot_carry_is_one_line_naming_the_variable_not_the_key(
    env, capsys, dagster_home, data_root, key
):
    env.setenv("FILTER_JUDGE_BASE_URL", "http://127.0.0.1:8000/v1")
    env.setenv("FILTER_JUDGE_MODEL", "m")
    env.setenv("FILTER_JUDGE_API_KEY", key)
    line = refused(capsys, "--judge", "llm")
    assert line.startswith("filter-pipeline: FILTER_JUDGE_API_KEY starts or ends with whitespace")
    assert "secret" not in line
    nothing_registered_or_written(dagster_home, data_root)


# --- what needs a run: the CLI as a user runs it ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name, value", [("FILTER_PIPELINE_EXECUTOR", "threads"), ("FILTER_JUDGE_VOTES", "3.5")])
def test_a_setting_the_code_location_reads_as_it_loads_is_one_line_in_a_fresh_process(cli, data_root, name, value):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    done = cli(env={name: value})
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"filter-pipeline: {name}="), done.stderr
    assert not (data_root / "warehouse").exists()


@pytest.mark.slow
def test_bad_records_a_refused_folder_and_bad_labels_each_get_their_line_and_the_rest_is_filtered(cli, data_root):
    tasks = [task("a"), task("b", macro="m@"), task("c", key=["s", "x"])]
    lines = [json.dumps(t) for t in tasks]
    lines[1] = lines[1].replace("m@", f"m{SURROGATE}")  # the escape as the file holds it: no text, in an identifier
    lines[2] = lines[2].replace('"x"]', "1" + "0" * 5000 + "]")  # more digits than Python converts
    attempts = [
        attempt("a"),
        attempt("b"),
        attempt("c"),
        attempt("a", 2, ok=False, error=f"assertion failed: {SURROGATE}"),  # free text: kept, with U+FFFD
    ]
    run = write_batch(data_root, "b1", [], [])
    (run / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    (run / "executions.jsonl").write_text(
        "\n".join(json.dumps(a) for a in attempts).replace("\\\\ud800", SURROGATE) + "\n"
    )
    write_batch(data_root, "b2", [task("d")], [attempt("d")])
    write_batch(data_root, ".hidden", [task("e")], [attempt("e")])
    write_batch(data_root, "with space", [task("e")], [attempt("e")])
    (data_root / "labels.jsonl").write_text('{"dir": "runs/r/traj/a/1", "success": true}\nnot a label\n')

    first = cli("b1")  # bad records alone: the batch is filtered, exit 0

    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == (
        "b1: judged 1, unjudged 0, kept 1, surplus 0, failure_pool 1 (script_assert 1), rejected lines 4 (batch_rejects)"
    )
    assert "Traceback" not in first.stderr
    done = cli()  # the rest: b2, and two folders refused for their names

    assert done.returncode == 1  # two complete folders were not filtered
    assert "Traceback" not in done.stderr and "Stack Trace" not in done.stderr
    refusals = [line for line in done.stderr.splitlines() if ": refused: " in line]
    assert [line.split(":")[0] for line in refusals] == ["runs/.hidden", "runs/with space"]
    assert all(line.endswith("; rename it") for line in refusals)
    assert done.stdout.splitlines()[0] == "b2: judged 1, unjudged 0, kept 1, surplus 0, failure_pool 0"
    rejects = pd.read_parquet(data_root / "warehouse" / "batch_rejects" / "b1.parquet")
    assert rejects[["file", "line", "field"]].values.tolist() == [
        ["executions.jsonl", 2, "task_id"], ["executions.jsonl", 3, "task_id"],
        ["tasks.jsonl", 2, "macro"], ["tasks.jsonl", 3, "dedup_key[1]"],
    ]  # fmt: skip
    assert "field 'macro' holds a lone surrogate (\\ud800), which is not text" in rejects["message"].iloc[2]
    pool = pd.read_parquet(data_root / "warehouse" / "failure_pool" / "b1.parquet")
    assert pool[["task_id", "attempt", "detail"]].values.tolist() == [["a", 2, "assertion failed: \ufffd"]]
    assert pd.read_parquet(data_root / "warehouse" / "kept")["task_id"].tolist() == ["a", "d"]
    assert "labels.jsonl:2: not JSON" in done.stderr  # judge_calibration's warning; its run succeeded
    assert (data_root / "warehouse" / "judge_calibration.parquet").exists()


@pytest.mark.slow
def test_a_failed_step_is_one_line_with_its_reason_and_where_the_full_log_is(cli, data_root, dagster_home):
    write_batch(data_root, "empty", [], [])
    done = cli("empty")
    assert done.returncode == 1
    [failed] = [line for line in done.stdout.splitlines() if "FAILED" in line]
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        [record] = instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": "empty"}))
        run_id = record.dagster_run.run_id
        failures = instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
    assert failed == (
        f"empty: FAILED (step judge_batch: runs/empty/tasks.jsonl holds no valid task; full log: run {run_id} on the "
        f"instance at $DAGSTER_HOME ({dagster_home}): `dagster dev` shows it at /runs/{run_id}, "
        f"`dagster debug export {run_id} run.gz` saves it)"
    )
    assert "Traceback" not in done.stderr and "Stack Trace" not in done.stderr and 'File "' not in done.stderr
    assert 'STEP_FAILURE - Execution of step "judge_batch" failed.' in done.stderr  # the INFO/ERROR lines stay
    # the full trace is in the run's event log
    error = failures[0].get_dagster_event().step_failure_data.error
    assert "holds no valid task" in error.to_string() and (error.stack or (error.cause and error.cause.stack))


@pytest.mark.slow
def test_an_output_that_cannot_be_written_names_the_cause_not_dagsters_wrapper(cli, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    (data_root / "warehouse" / "batch_tasks" / "b1.parquet" / "in-the-way").mkdir(parents=True)
    done = cli("b1")
    assert done.returncode == 1
    [failed] = [line for line in done.stdout.splitlines() if "FAILED" in line]
    assert failed.startswith("b1: FAILED (step "), failed
    assert "batch_tasks" in failed and "Error occurred while handling output" not in failed, failed


def test_every_judge_variable_the_help_names_is_one_the_judge_reads():
    import re

    from filter_pipeline.cli.main import _parser
    from filter_pipeline.judge.config import ENV

    commands = next(a for a in _parser()._actions if a.choices and "calibrate" in a.choices).choices
    helps = " ".join(a.help or "" for name in ("materialize", "calibrate") for a in commands[name]._actions)
    named = set(re.findall(r"FILTER_JUDGE_[A-Z_]+", helps))
    assert len(named) >= 5 and named <= set(ENV.values())
