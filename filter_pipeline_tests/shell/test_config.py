"""Caps validation: strict, one line per problem, and what it accepts Dagster's run config check accepts."""

import dagster as dg
import pytest

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.config import load_caps_file, parse_caps


@pytest.fixture(scope="module")
def ledger_job():
    return build_defs("data", JudgeResource(), caps={}).resolve_job_def("ledger_job")


@pytest.mark.parametrize(
    "caps",
    [{}, {"per_site_cap": 0}, {"per_site_cap": 5, "caps": {"m": {"site_cap": 1, "target": 10}}}, {"caps": {"m": {}}},
     {"caps": {"m": {"target": None}}}, {"caps": None}, {"per_site_cap": None}],
)  # fmt: skip
def test_what_parse_caps_accepts_dagster_accepts_as_run_config(ledger_job, caps):
    assert parse_caps(caps, "here") == {k: v for k, v in caps.items() if v is not None}  # null: not set
    checked = dg.validate_run_config(
        ledger_job, {"ops": {"ledger": {"config": {k: v for k, v in caps.items() if v is not None}}}}
    )
    assert checked["ops"]["ledger"]["config"]["per_site_cap"] == (
        3 if caps.get("per_site_cap") is None else caps["per_site_cap"]
    )


@pytest.mark.parametrize(
    "caps, message",
    [
        ({"per_site_cap": "2"}, 'here: per_site_cap: Input should be a valid integer (got "2")'),
        ({"per_site_cap": 2.0}, "here: per_site_cap: Input should be a valid integer (got 2.0)"),
        ({"per_site_cap": True}, "here: per_site_cap: Input should be a valid integer (got true)"),
        ({"caps": {"m": {"site_cap": False}}}, "here: caps.m.site_cap: Input should be a valid integer (got false)"),
        ({"caps": {"m": {"target": "10"}}}, 'here: caps.m.target: Input should be a valid integer (got "10")'),
        ({"caps": {"m": {"target": -1}}}, "here: caps.m.target: must be 0 or more, got -1"),
        ({"caps": {"m": {"tagret": 1}}}, "here: caps.m has unknown key(s) tagret"),
        ({"caps": "m"}, 'here: caps must be a mapping {macro: {site_cap, target}}, got "m"'),
        ({"caps": {"m": 3}}, "here: caps.m must be a mapping with site_cap and/or target"),
        ({1: 2}, "here: unknown key(s) 1; allowed: per_site_cap, caps"),
    ],
)
def test_what_dagster_would_refuse_parse_caps_refuses_in_one_line(ledger_job, caps, message):
    with pytest.raises(ValueError) as refused:
        parse_caps(caps, "here")
    assert str(refused.value) == message
    if "Input should be" in message:  # a type Dagster's own check refuses too (a value error fails the run later)
        with pytest.raises(dg.DagsterInvalidConfigError):
            dg.validate_run_config(ledger_job, {"ops": {"ledger": {"config": caps}}})


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("c.yaml", "per_site_cap: 2\nper_site_cap: 2\n", 'c.yaml:2:1: key "per_site_cap" appears twice'),
        ("c.yml", "caps:\n  m: {site_cap: 1, site_cap: 2}\n", 'c.yml:2:20: key "site_cap" appears twice'),
        ("c.json", '{"per_site_cap": 1, "per_site_cap": 2}', 'c.json: key "per_site_cap" appears twice'),
        (
            "c.yaml",
            "per_site_cap: [\n",
            "c.yaml:2:1: not YAML or JSON: while parsing a flow node expected the node content, but found '<stream end>'",
        ),
        (
            "c.yaml",
            "\tper_site_cap: 2\n",
            "c.yaml:1:1: not YAML or JSON: while scanning for the next token found character '\\t' that cannot start any token",
        ),
        ("c.json", '{"per_site_cap": 2', "c.json:1:19: not JSON: Expecting ',' delimiter"),
    ],
)
def test_a_caps_file_that_does_not_parse_or_names_a_key_twice_is_one_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as refused:
        load_caps_file(tmp_path / name)
    assert str(refused.value) == f"caps file {tmp_path}/{message}"
    assert "\n" not in str(refused.value)


def test_a_caps_file_that_is_not_utf8_or_not_there_is_one_line(tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"per_site_cap: \xff\n")
    with pytest.raises(ValueError, match=r"^caps file .*/c.yaml: not UTF-8 text \(invalid start byte at byte 14\)$"):
        load_caps_file(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match=r"^caps file .*/none.yaml: No such file or directory$"):
        load_caps_file(tmp_path / "none.yaml")


def test_an_empty_caps_file_is_no_caps(tmp_path):
    (tmp_path / "c.yaml").write_text("# nothing yet\n")
    assert load_caps_file(tmp_path / "c.yaml") == {}
