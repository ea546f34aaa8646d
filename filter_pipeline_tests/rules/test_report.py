"""The per-run report: figures that add up, charts that are images, a page that stands alone."""

import dagster as dg
import pandas as pd

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules import report
from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline_tests.builders import attempt, chart_bars, task, write_batch


def sample_run(data_root) -> dg.ExecuteInProcessResult:
    tasks = [task("a", key=["k"]), task("b", key=["k"]), task("c", site="s2"), task("d", site="s2")]
    attempts = [
        attempt("a", 1, ok=False, error="policy violation: x"), attempt("a", 2), attempt("b"), attempt("c"),
        attempt("d", 1, ok=False, error="backend check failed: y"), attempt("d", 2, ok=False, error="z"),
    ]  # fmt: skip
    write_batch(data_root, "r1", tasks, attempts)
    with dg.DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("run_id", ["r1"])
        job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("filter_job")
        return job.execute_in_process(instance=instance, partition_key="r1")


def test_report_figures_match_a_hand_count(data_root):
    result = sample_run(data_root)
    frame = pd.read_parquet(data_root / "warehouse" / "filter_report" / "r1.parquet")
    funnel = frame[frame["section"] == "funnel"].set_index("key")["value"].to_dict()
    assert funnel == {"attempts": 6, "ok attempts": 3, "judged tasks": 3, "passed": 3, "kept": 2}
    site = frame[frame["section"] == "site"].pivot(index="key", columns="metric", values="value")
    assert site.loc["s", ["judged", "kept", "policy_violation"]].tolist() == [2, 1, 1]
    assert site.loc["s2", ["judged", "kept", "backend_fail", "script_error"]].tolist() == [1, 1, 1, 1]
    surplus = frame[frame["section"] == "surplus"].set_index("key")["value"].to_dict()
    assert surplus == {"duplicate": 1, "site_cap": 0, "target": 0}

    [mat] = [m for m in result.get_asset_materialization_events() if m.asset_key.path[-1] == "filter_report"]
    meta = mat.materialization.metadata
    assert meta["report"].value.count("](data:image/svg+xml;base64,") == 2
    page = (data_root / "warehouse" / "filter_report_html" / "r1.html").read_text()
    assert page.startswith("<!doctype html>") and page.count("<img") == 2 and "Filter report: r1" in page
    # the judge and cost figures in words; in long form, numbers only (the judge's kind is text)
    assert "<li>judge: gate</li>" in page and "<li>cost, all verdicts: not priced</li>" in page
    assert "<li>verdicts reused (no request): 0</li>" in page
    cost = frame[frame["section"] == "cost"].set_index("key")["value"]
    assert "judge" not in cost and cost["requests"] == 0 and pd.isna(cost["cost"])


def test_the_report_says_which_caps_the_walk_used_and_where_they_came_from(data_root):
    write_batch(data_root, "r1", [task("a", macro="buy"), task("b", macro="buy")], [attempt("a"), attempt("b")])
    caps = {"per_site_cap": 5, "caps": {"buy": {"site_cap": 1, "target": 9}, "search": {"target": 4}}}
    with dg.DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("run_id", ["r1"])
        job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("filter_job")
        run_config = {"ops": {"ledger": {"config": caps}}}
        assert job.execute_in_process(instance=instance, partition_key="r1", run_config=run_config).success
    frame = pd.read_parquet(data_root / "warehouse" / "filter_report" / "r1.parquet")
    used = frame[frame["section"] == "caps"].set_index(["key", "metric"])["value"].to_dict()
    assert used == {
        (report.DEFAULT_CAPS, "site_cap"): 5, ("buy", "site_cap"): 1, ("buy", "target"): 9,
        ("search", "site_cap"): 5, ("search", "target"): 4,
    }  # fmt: skip
    page = (data_root / "warehouse" / "filter_report_html" / "r1.html").read_text()
    assert "<h2>Caps (run config)</h2>" in page and "<td>buy</td><td>1</td><td>9</td>" in page
    assert (data_root / "warehouse" / "kept" / "r1.parquet").exists()
    assert len(pd.read_parquet(data_root / "warehouse" / "kept" / "r1.parquet")) == 1  # (buy's site_cap of 1 held)


def test_funnel_only_narrows(data_root):
    sample_run(data_root)
    frame = pd.read_parquet(data_root / "warehouse" / "filter_report" / "r1.parquet")
    counts = frame[frame["section"] == "funnel"]["value"].tolist()
    assert counts == sorted(counts, reverse=True)


def test_charts_show_the_funnel_top_down_and_failure_reasons_of_the_busiest_sites():
    f = report.figures(
        attempts=pd.DataFrame({"ok": pd.array([True, True, False, False], dtype="boolean")}),
        verdicts=pd.DataFrame({"task_id": ["a", "b"], "site": ["s", "t"], "macro": ["m", "m"], "status": ["judged"] * 2,
                               "passed": pd.array([True, True], dtype="boolean"), "judge": ["gate"] * 2, "calls": [0, 0],
                               "cached": [False] * 2, "prompt_tokens": [0, 0], "completion_tokens": [0, 0]}),
        pool=pd.DataFrame({"site": ["s", "t", "t"], "macro": ["m"] * 3, "reason": ["unknown", "unknown", "script_error"]}),
        kept=pd.DataFrame({"site": ["s"], "macro": ["m"]}),
        surplus=pd.DataFrame({"dropped": pd.Series(["duplicate"], dtype=object)}),
        caps=Caps(per_site_cap=3), caps_source="deployment",
    )  # fmt: skip
    images = report.charts(f, top_sites=1)
    assert set(images) == {"funnel", "reasons_per_site"}
    [funnel] = chart_bars(images["funnel"]).values()
    assert list(funnel.items()) == [
        ("attempts", 4),
        ("ok attempts", 2),
        ("judged tasks", 2),
        ("passed", 2),
        ("kept", 1),
    ]
    assert chart_bars(images["reasons_per_site"]) == {"script_error": {"t": 1}, "unknown": {"t": 1}}  # t: 2 failures


def test_the_html_page_holds_every_table_cell_escaped_with_missing_values_blank():
    f = report.Figures(
        funnel=pd.DataFrame({"step": ["attempts"], "count": [3]}),
        by_site=pd.DataFrame({"site": ["<b>x</b>", "y"], "keep_rate": [0.5, None]}),
        by_macro=pd.DataFrame({"macro": ["m"]}),
        surplus=pd.DataFrame({"dropped": ["duplicate"], "count": [1]}),
        agreement_by_site=pd.DataFrame({"site": []}),
        cost={"calls": 0},
        caps=report.caps_table(Caps(3, {"<i>m</i>": MacroLimits(target=2), "a|b": MacroLimits(site_cap=1)})),
        caps_source="run config",
    )
    page = report.html(f, {"funnel": b"", "reasons_per_site": b""}, "r1")
    markdown = report.markdown(f, {"funnel": b"", "reasons_per_site": b""}, "r1")
    assert "| <i>m</i> | 3 | 2 |" in markdown and "| a\\|b | 1 |  |" in markdown  # (a | inside a cell escaped)
    assert "<td>&lt;b&gt;x&lt;/b&gt;</td><td>0.5</td>" in page
    assert "<td>&lt;i&gt;m&lt;/i&gt;</td><td>3</td><td>2</td>" in page
    assert "<tr><td>y</td><td></td></tr>" in page
    assert "<th>site</th><th>keep_rate</th>" in page


def test_blocked_judge_failures_show_per_site_so_a_site_that_keeps_blocking_stands_out():
    verdicts = pd.DataFrame({"site": ["s1", "s1", "s2"], "macro": ["m"] * 3, "status": ["judged"] * 3,
                             "passed": [False, False, False]})  # fmt: skip
    pool = pd.DataFrame({"site": ["s1", "s1", "s2", "s2"], "macro": ["m"] * 4,
                         "reason": ["judge_fail", "judge_fail", "judge_fail", "script_error"],
                         "blocked": pd.array([True, True, False, None], dtype="boolean")})  # fmt: skip
    empty = pd.DataFrame({"site": [], "macro": [], "dropped": []})
    f = report.figures(pd.DataFrame({"ok": [True] * 3}), verdicts, pool, empty, empty, Caps(3), "deployment")
    assert f.by_site.set_index("site")[["judge_fail", "blocked"]].to_dict("index") == {
        "s1": {"judge_fail": 2, "blocked": 2},
        "s2": {"judge_fail": 1, "blocked": 0},
    }
    assert f.by_macro["blocked"].tolist() == [2]
    long = report.long_form(f)
    assert long[(long["section"] == "site") & (long["metric"] == "blocked")]["value"].tolist() == [2, 0]


def test_the_agreement_tables_keep_a_site_holding_a_bar_in_its_own_cell():
    verdicts = pd.DataFrame(
        {"site": ["a|b", "a|b", "c"], "macro": ["m", "m", "m"], "status": "judged", "passed": [True, False, True]}
    )
    site_table, macro_table = report.agreement_markdown(verdicts).split("\n\n")
    assert site_table.splitlines() == [
        "| site | judged | agreed with gate | rate |",
        "|---|---|---|---|",
        "| a\\|b | 2 | 1 | 50% |",
        "| c | 1 | 1 | 100% |",
    ]
    assert macro_table.splitlines()[2] == "| m | 3 | 2 | 67% |"
