"""Coverage: kept rows per (macro, site) and per macro across all non-retired runs, against caps and targets.
What is full and what is short decides the next batch to generate. Pure pandas."""

import pandas as pd

from filter_pipeline.rules.descriptions import markdown_table
from filter_pipeline.rules.filtering import Caps
from filter_pipeline.rules.report import add_series, bar_chart, svg
from filter_pipeline.rules.schemas import conform


def coverage_table(counts: pd.DataFrame, caps: Caps) -> pd.DataFrame:
    """Rows of level `site` (one per macro and site with kept rows: its site cap) and level `macro` (one per
    macro: its target, or none). `remaining` is how many more the limit allows; `full` whether it allows none."""
    site = counts.assign(
        level="site",
        kept=counts["n_kept"],
        limit=caps.site_caps(counts["macro"]),
    )
    per_macro = counts.groupby("macro", as_index=False)["n_kept"].sum()
    # a macro with a target shows, even before it has a kept row
    started = set(per_macro["macro"].unique())
    unstarted = pd.DataFrame({"macro": [m for m in caps.targeted() if m not in started], "n_kept": 0})
    per_macro = pd.concat([per_macro, unstarted], ignore_index=True)
    macro = per_macro.assign(level="macro", site=None, kept=per_macro["n_kept"], limit=caps.targets(per_macro["macro"]))
    table = pd.concat([macro, site], ignore_index=True)
    limit = table["limit"].astype("Int64")
    table["remaining"] = (limit - table["kept"].astype("Int64")).clip(lower=0)
    table["full"] = (table["kept"].astype("Int64") >= limit).astype("boolean")
    return conform(table.sort_values(["level", "macro", "site"], kind="stable", na_position="first"), "coverage")


def coverage_markdown(table: pd.DataFrame, limit: int = 30) -> str:
    """The per-macro rows, then the sites closest to full, as markdown for the UI."""
    shown = pd.concat(
        [table[table["level"] == "macro"], table[table["level"] == "site"].sort_values("remaining").head(limit)]
    )
    return markdown_table(shown[["level", "macro", "site", "kept", "limit", "remaining"]])


def coverage_chart(table: pd.DataFrame, top: int = 25) -> bytes:
    """SVG: kept rows per macro (the `top` with most), beside its target where one is set."""
    macros = table[table["level"] == "macro"].sort_values("kept", ascending=False).head(top)
    graph = bar_chart("kept rows per macro, all runs", macros["macro"].astype(str).tolist())
    add_series(graph, "kept", macros["kept"])
    if macros["limit"].notna().any():
        add_series(graph, "target", macros["limit"])
    return svg(graph)
