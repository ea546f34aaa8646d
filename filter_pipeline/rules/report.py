"""The per-run report: the funnel, keep rate and failure reasons per site and macro, surplus by reason, judge
pass rate and agreement with the gate, cost; as tables, SVG charts and one standalone HTML page.

Figures are plain pandas (`figures`); rendering (`charts`, `markdown`, `html`) only formats them.
"""

import base64
import html as html_lib
from dataclasses import dataclass

import pandas as pd
import pygal
from pygal.style import Style

from filter_pipeline.rules.descriptions import markdown_table
from filter_pipeline.rules.filtering import Caps, unjudged_count
from filter_pipeline.rules.schemas import EVIDENCE_TRAJECTORY, SPEND_COUNTS
from filter_pipeline.rules.vocabulary import DROPPED_REASONS, FAILURE_REASONS, STATUS_JUDGED

BLOCKED = "blocked"  # the per-site and per-macro column of judge failures the judge found blocked by the site
FUNNEL_STEPS = ("attempts", "ok attempts", "judged tasks", "passed", "kept")
COST_COLUMNS = (*SPEND_COUNTS, "cost")


@dataclass(frozen=True)
class Figures:
    funnel: pd.DataFrame  # step, count
    by_site: pd.DataFrame  # site, judged, kept, keep_rate, <failure reasons...>, blocked
    by_macro: pd.DataFrame  # macro, same columns
    surplus: pd.DataFrame  # dropped, count
    agreement_by_site: pd.DataFrame
    cost: dict
    caps: pd.DataFrame  # macro (DEFAULT_CAPS: every other macro), site_cap, target: the caps the walk used
    caps_source: str  # "deployment" or "run config"


DEFAULT_CAPS = "(every other macro)"  # the caps table's row of the run's per_site_cap


def figures(
    attempts: pd.DataFrame,
    verdicts: pd.DataFrame,
    pool: pd.DataFrame,
    kept: pd.DataFrame,
    surplus: pd.DataFrame,
    caps: Caps,
    caps_source: str,
) -> Figures:
    """Every figure of the report from one run's outputs, and the caps its walk used (from `caps_source`)."""
    is_judged = (verdicts["status"] == STATUS_JUDGED).to_numpy(dtype=bool)
    judged = verdicts.loc[is_judged, ["macro", "site"]]  # (only what the tables group by: no copy of every column)
    passed = int((verdicts["passed"][is_judged] == True).sum())  # noqa: E712
    funnel = pd.DataFrame(
        {
            "step": FUNNEL_STEPS,
            "count": [len(attempts), int((attempts["ok"] == True).sum()), len(judged), passed, len(kept)],  # noqa: E712
        }
    )
    return Figures(
        funnel=funnel,
        by_site=_by(judged, kept, pool, "site"),
        by_macro=_by(judged, kept, pool, "macro"),
        surplus=pd.DataFrame(
            {"dropped": DROPPED_REASONS, "count": [int((surplus["dropped"] == r).sum()) for r in DROPPED_REASONS]}
        ),
        agreement_by_site=agreement(verdicts, "site"),
        cost=judge_cost(verdicts, passed, len(judged)),
        caps=caps_table(caps),
        caps_source=caps_source,
    )


def caps_table(caps: Caps) -> pd.DataFrame:
    """The caps as a table: the per_site_cap first, then each macro with limits of its own."""
    rows = [(DEFAULT_CAPS, caps.per_site_cap, None)]
    rows += [(macro, caps.site_cap(macro), limits.target) for macro, limits in sorted(caps.macros.items())]
    return pd.DataFrame(
        {
            "macro": [r[0] for r in rows],
            "site_cap": pd.array([r[1] for r in rows], dtype="Int64"),
            "target": pd.array([r[2] for r in rows], dtype="Int64"),
        }
    )


def judge_cost(verdicts: pd.DataFrame, passed: int, judged: int) -> dict:
    """The report's judge and cost section. Each verdict carries what it cost when it was asked (a reused one
    too, a deduplicated copy 0), the earlier tries that left its task unjudged included: `requests`, tokens and
    `cost` are what this run's verdicts cost in all. What one materialization paid is its judge_verdicts
    metadata. `cost` is None when not priced."""
    verdicts = verdicts.reindex(columns=["judge", "status", "cached", "deduplicated", "evidence", *COST_COLUMNS])
    asked_now = ~verdicts["cached"].astype(object).fillna(False).astype(bool)
    total = {c: pd.to_numeric(verdicts[c], errors="coerce") for c in COST_COLUMNS}
    evidence = verdicts["evidence"].dropna()
    return {
        "judge": ", ".join(sorted(verdicts["judge"].dropna().unique().tolist())) or "none",
        **{c: int(total[c].fillna(0).sum()) for c in COST_COLUMNS if c != "cost"},
        "cost": round(float(total["cost"].sum()), 6) if total["cost"].notna().any() else None,
        "cache_hits": int((~asked_now).sum()),
        "deduplicated": int(verdicts["deduplicated"].astype(object).fillna(False).astype(bool).sum()),
        "evidence_missing": int((evidence != EVIDENCE_TRAJECTORY).sum()),
        "unjudged": unjudged_count(verdicts),
        "judge_pass_rate": round(passed / judged, 4) if judged else None,
    }


# how the report's page and markdown name each judge_cost figure (the long form keeps the keys)
COST_LABELS = {
    "judge": "judge",
    "requests": "requests, all verdicts (reused ones count what they cost when asked, each its unjudged tries)",
    "prompt_tokens": "prompt tokens, all verdicts",
    "completion_tokens": "completion tokens, all verdicts",
    "cached_tokens": "of the prompt tokens, served from the endpoint's prompt cache",
    "cost": "cost, all verdicts",
    "cache_hits": "verdicts reused (no request)",
    "deduplicated": "verdicts copied from an identical prompt of this batch",
    "evidence_missing": "verdicts made without the attempt's whole trajectory.json (the record's steps instead of its own)",
    "unjudged": "tasks left unjudged (judged again later)",
    "judge_pass_rate": "judge pass rate",
}


def _cost_lines(cost: dict) -> list[tuple[str, str]]:
    """(label, value) of each judge_cost figure as the page and markdown show it (a missing price: not priced)."""
    lines = []
    for key, value in cost.items():
        if value is None:
            value = "not priced" if key.startswith("cost") else "–"
        lines.append((COST_LABELS.get(key, key), str(value)))
    return lines


def _by(judged: pd.DataFrame, kept: pd.DataFrame, pool: pd.DataFrame, key: str) -> pd.DataFrame:
    groups = sorted(pd.Index(judged[key].unique()).union(pd.Index(pool[key].dropna().unique())).tolist())
    table = pd.DataFrame({key: groups})
    table["judged"] = table[key].map(judged[key].value_counts()).fillna(0).astype(int)
    table["kept"] = table[key].map(kept[key].value_counts()).fillna(0).astype(int)
    table["keep_rate"] = (table["kept"] / table["judged"].where(table["judged"] > 0)).round(3)
    reasons = pool.groupby([key, "reason"]).size().unstack(fill_value=0) if len(pool) else pd.DataFrame()
    for reason in FAILURE_REASONS:
        table[reason] = (
            table[key].map(reasons[reason] if reason in reasons else pd.Series(dtype=int)).fillna(0).astype(int)
        )
    # judge failures the judge put down to the site (CAPTCHA, bot wall, site down): a site problem, not the agent's
    blocked = pool[(pool["blocked"] == True).fillna(False)] if "blocked" in pool else pool.iloc[:0]  # noqa: E712
    table[BLOCKED] = table[key].map(blocked[key].value_counts()).fillna(0).astype(int)
    return table


def agreement(verdicts: pd.DataFrame, by: str) -> pd.DataFrame:
    """How often the judge agreed with the gate, per `by` (site or macro).

    The gate passed every attempt the judge saw, so agreement is the judge's pass rate among judged verdicts.
    """
    judged = verdicts.loc[(verdicts["status"] == STATUS_JUDGED).to_numpy(dtype=bool), [by, "passed"]]
    grouped = judged.assign(agreed=(judged["passed"] == True).astype(int)).groupby(by)["agreed"]  # noqa: E712
    return (
        pd.DataFrame({"judged": grouped.size(), "agreed": grouped.sum()})
        .assign(rate=lambda d: (d["agreed"] / d["judged"]).round(3))
        .reset_index()
    )


def agreement_markdown(verdicts: pd.DataFrame) -> str:
    parts = []
    for by in ("site", "macro"):
        table = agreement(verdicts, by)
        shown = pd.DataFrame({by: table[by], "judged": table["judged"], "agreed with gate": table["agreed"],
                              "rate": [f"{rate:.0%}" for rate in table["rate"]]})  # fmt: skip
        parts.append(markdown_table(shown))
    return "\n\n".join(parts)


# --- rendering --------------------------------------------------------------------------------------


# pygal, not matplotlib: the same bar charts as SVG, with a fraction of matplotlib's import and drawing time
# (which would be a noticeable share of a large batch's run)
_STYLE = Style(
    background="white", plot_background="white", font_family="sans-serif",
    colors=("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#9d755d"),
)  # fmt: skip


def bar_chart(title: str, labels: list[str], stacked: bool = False, width: int = 700, **options) -> pygal.Graph:
    """A horizontal bar chart, one row per label from the top down, ready for `add(series, values)`."""
    kind = pygal.HorizontalStackedBar if stacked else pygal.HorizontalBar
    return kind(
        title=title, x_labels=list(reversed(labels)), width=width, height=24 * max(len(labels), 3) + 110,
        style=_STYLE, js=[],  # no script: the chart is shown as an image, and it must not reach the network
        truncate_label=-1, truncate_legend=-1, legend_at_bottom=True, **options,
    )  # fmt: skip


def add_series(graph: pygal.Graph, name: str, values) -> None:
    """Add a series given top-down in label order (None: no bar for that label)."""
    graph.add(name, [None if v is None or pd.isna(v) else int(v) for v in reversed(list(values))])


def svg(graph: pygal.Graph) -> bytes:
    """The chart as a standalone SVG document."""
    return graph.render()


def charts(f: Figures, top_sites: int = 15) -> dict[str, bytes]:
    """SVG charts: the funnel, and failure reasons for the sites with the most failures."""
    funnel = bar_chart("funnel", f.funnel["step"].tolist(), print_values=True, show_legend=False, width=600)
    add_series(funnel, "count", f.funnel["count"])
    out = {"funnel": svg(funnel)}

    reasons = [r for r in FAILURE_REASONS if f.by_site[r].sum() > 0]
    busiest = f.by_site.assign(total=f.by_site[list(FAILURE_REASONS)].sum(axis=1)).nlargest(top_sites, "total")
    per_site = bar_chart(
        f"failure reasons per site (top {len(busiest)})", busiest["site"].astype(str).tolist(), stacked=True
    )
    for reason in reasons:
        add_series(per_site, reason, busiest[reason])
    out["reasons_per_site"] = svg(per_site)
    return out


def data_uri(image: bytes) -> str:
    """An SVG chart as a data: URI (Dagster's markdown allows data: images; a page needs no other file)."""
    return f"data:image/svg+xml;base64,{base64.b64encode(image).decode()}"


def image_md(name: str, image: bytes) -> str:
    """An SVG chart as an inline markdown image (how Dagster's UI shows charts in metadata)."""
    return f"![{name}]({data_uri(image)})"


def markdown(f: Figures, images: dict[str, bytes], run_id: str) -> str:
    """The report as markdown with the charts inline (what the Dagster UI shows)."""
    cost = "\n".join(f"- {label}: {value}" for label, value in _cost_lines(f.cost))
    return "\n\n".join(
        [
            f"## Filter report: {run_id}",
            image_md("funnel", images["funnel"]),
            markdown_table(f.funnel),
            "### Per site",
            image_md("reasons per site", images["reasons_per_site"]),
            markdown_table(f.by_site),
            "### Per macro",
            markdown_table(f.by_macro),
            "### Surplus",
            markdown_table(f.surplus),
            "### Judge agreement with the gate, per site",
            markdown_table(f.agreement_by_site),
            "### Judge and cost",
            cost,
            f"### Caps ({f.caps_source})",
            markdown_table(f.caps),
        ]
    )


def html(f: Figures, images: dict[str, bytes], run_id: str) -> str:
    """A standalone HTML page of the report (charts embedded)."""

    def table(frame: pd.DataFrame) -> str:
        # by hand: pandas' to_html is slow on the per-site table of a large batch
        head = "".join(f"<th>{html_lib.escape(str(c))}</th>" for c in frame.columns)
        cells = frame.astype(object).where(frame.notna(), "")
        rows = "".join(
            "<tr>" + "".join(f"<td>{html_lib.escape(str(v))}</td>" for v in row) + "</tr>"
            for row in cells.itertuples(index=False)
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"

    def image(name: str) -> str:
        return f'<img alt="{name}" src="{data_uri(images[name])}">'

    cost = "".join(
        f"<li>{html_lib.escape(label)}: {html_lib.escape(value)}</li>" for label, value in _cost_lines(f.cost)
    )
    title = html_lib.escape(f"Filter report: {run_id}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}</style></head><body>"
        f"<h1>{title}</h1>{image('funnel')}{table(f.funnel)}"
        f"<h2>Per site</h2>{image('reasons_per_site')}{table(f.by_site)}"
        f"<h2>Per macro</h2>{table(f.by_macro)}<h2>Surplus</h2>{table(f.surplus)}"
        f"<h2>Judge agreement with the gate, per site</h2>{table(f.agreement_by_site)}"
        f"<h2>Judge and cost</h2><ul>{cost}</ul>"
        f"<h2>Caps ({html_lib.escape(f.caps_source)})</h2>{table(f.caps)}</body></html>"
    )


def long_form(f: Figures) -> pd.DataFrame:
    """The figures as one (section, key, metric, value) frame: the report's Parquet partition."""
    parts = [f.funnel.assign(section="funnel", key=f.funnel["step"], metric="count").rename(columns={"count": "value"})]
    for section, frame, key in (("site", f.by_site, "site"), ("macro", f.by_macro, "macro")):
        melted = frame.melt(id_vars=[key], var_name="metric", value_name="value").rename(columns={key: "key"})
        parts.append(melted.assign(section=section))
    parts.append(
        f.surplus.assign(section="surplus", key=f.surplus["dropped"], metric="count").rename(columns={"count": "value"})
    )
    numbers = {key: value for key, value in f.cost.items() if not isinstance(value, str)}  # (the judge's kind: text)
    parts.append(
        pd.DataFrame({"section": "cost", "key": list(numbers), "metric": "value", "value": list(numbers.values())})
    )
    caps = f.caps.melt(id_vars=["macro"], var_name="metric", value_name="value").rename(columns={"macro": "key"})
    parts.append(caps[caps["value"].notna()].assign(section="caps"))
    frame = pd.concat(parts, ignore_index=True)[["section", "key", "metric", "value"]]
    return frame.assign(key=frame["key"].astype(str), value=pd.to_numeric(frame["value"], errors="coerce"))
