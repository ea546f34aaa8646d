"""Coverage against caps and targets."""

from filter_pipeline.rules.coverage import coverage_chart, coverage_markdown, coverage_table
from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline_tests.builders import chart_bars, counts, rows


def test_sites_and_macros_against_their_limits():
    table = coverage_table(
        counts(("m", "s1", 3), ("m", "s2", 1), ("n", "s1", 5)),
        Caps(per_site_cap=3, macros={"n": MacroLimits(site_cap=10, target=4), "t": MacroLimits(target=2)}),
    )
    assert rows(table, "level", "macro", "site", "kept", "limit", "remaining", "full") == [
        ["macro", "m", None, 4, None, None, None],
        ["macro", "n", None, 5, 4, 0, True],
        ["macro", "t", None, 0, 2, 2, False],
        ["site", "m", "s1", 3, 3, 0, True],
        ["site", "m", "s2", 1, 3, 2, False],
        ["site", "n", "s1", 5, 10, 5, False],
    ]


def test_coverage_equals_the_sum_of_kept_rows():
    c = counts(("m", "a", 2), ("m", "b", 7), ("x", "a", 1))
    table = coverage_table(c, Caps(3))
    assert table.loc[table["level"] == "site", "kept"].sum() == c["n_kept"].sum() == 10
    assert table.loc[table["level"] == "macro", "kept"].sum() == 10


def test_coverage_chart_shows_kept_per_macro_most_first_beside_its_target():
    table = coverage_table(counts(("m", "a", 2), ("n", "b", 1), ("n", "c", 4)), Caps(3, {"m": MacroLimits(target=5)}))
    shown = coverage_chart(table)
    assert list(chart_bars(shown)["kept"].items()) == [("n", 5), ("m", 2)]
    assert chart_bars(shown)["target"] == {"m": 5}


def test_the_coverage_table_in_the_ui_keeps_a_site_holding_a_bar_in_its_own_cell():
    shown = coverage_markdown(coverage_table(counts(("m", "a|b", 2)), Caps(3)))
    assert shown.splitlines() == [
        "| level | macro | site | kept | limit | remaining |",
        "|---|---|---|---|---|---|",
        "| macro | m |  | 2 |  |  |",
        "| site | m | a\\|b | 2 | 3 | 1 |",
    ]
