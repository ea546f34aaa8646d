"""`filter-pipeline explain RUN_ID TASK_ID`: a task's whole story as text (what the review app's task page shows)."""

import argparse
import json
import re

from filter_pipeline.cli import EXIT_BAD_INPUT, EXIT_FAILED, add_data_argument, complain

PAGE_TEXT_CHARS = 1200  # of the final page text printed (the review page shows more: `story.CHARS_SHOWN`)
# what a terminal acts on rather than shows: the C0 controls but the tab (an escape sequence's ESC; a carriage
# return or a line break, which could forge a line of the story), DEL, the C1 controls and the Unicode line and
# paragraph separators
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def add_parser(commands) -> None:
    e = commands.add_parser(
        "explain",
        help="why a task was kept or dropped: its whole story as text",
        description="Print a task's story: every attempt, the judged attempt's trajectory, the verdict, the "
        "walk's decision (kept, surplus and why, judge_fail, unjudged, execute failures only, reject), its DPO "
        "pair and labels. Exit 1 when the run or task does not exist or a file its story needs cannot be read; 2 when "
        "RUN_ID is not a plain folder name, or the data root does not exist or has no runs/.",
    )
    e.add_argument("run_id", metavar="RUN_ID")
    e.add_argument("task_id", metavar="TASK_ID")
    add_data_argument(e)


def explain(args: argparse.Namespace) -> int:
    from filter_pipeline.cli.data_root import existing_root
    from filter_pipeline.review.data import ReviewError, UnreadableFile, Warehouse
    from filter_pipeline.review.story import Labels, story
    from filter_pipeline.rules.batch import check_run_id

    try:
        check_run_id(args.run_id)
    except ValueError as exc:  # (a path such as ../.. is a bad argument, not a run that is missing)
        complain(str(exc))
        return EXIT_BAD_INPUT
    root = existing_root(args.data)
    if root is None:
        return EXIT_BAD_INPUT
    warehouse = Warehouse(root)
    if problem := warehouse.problem():
        complain(problem, warning=True)
    try:
        found = story(warehouse, args.run_id, args.task_id, Labels(root).frame())
    except (ReviewError, UnreadableFile) as exc:
        complain(str(exc))
        return EXIT_FAILED
    print("\n".join(map(printable, story_lines(found))))
    return 0


def printable(line: str) -> str:
    """`line` as a terminal shows it, character for character: each control character written as its Python
    escape (page text and reasoning are any website's and any model's text)."""
    return _CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), line)


def _yes(value) -> str:
    return {True: "yes", False: "no"}.get(value, "-")


def _or_dash(value) -> str:
    return "-" if value is None or value != value else str(value)  # (None, or NaN: a null)


def story_lines(s: dict) -> list[str]:
    """The story as lines of text."""
    from filter_pipeline.review.fates import REASON_RETIRED

    task, decision = s["task"], s["decision"]
    reason = decision.get("reason")
    lines = [f"task {task['task_id']} of run {s['run_id']}: {decision['fate']}"
             + (f" ({reason})" if reason and reason != decision["fate"] else ""),
             f"  {decision['where']}" if decision.get("where") else "  -",
             f"  site {task['site'] or '-'}, macro {task['macro'] or '-'}", f"  instruction: {task['instruction'] or '-'}",
             f"  dedup key: {task.get('dedup_key') or '-'}"]  # fmt: skip
    if decision.get("reason") == REASON_RETIRED:
        because = f" ({decision['retired_because']})" if decision.get("retired_because") else ""
        lines.append(f"  retired by retired.json{because}: it stays in kept but no longer counts for dedup or caps")
    if decision.get("run_refused"):
        lines.append(f"  {decision['run_refused']}")
    if decision.get("duplicate_of"):
        dup = decision["duplicate_of"]
        lines.append(f"  duplicate of task {dup['task_id']} of run {dup['run_id']}, which kept the key first")
    if decision.get("cap"):
        cap = decision["cap"]
        lines.append(f"  cap met ({cap['reason']}): limit {cap['limit']}, reached by {cap['kept_before']} kept rows in "
                     f"history and {cap['kept_in_run']} in this run ({cap['caps_source']} caps)")  # fmt: skip
    lines.append("attempts:")
    for a in s["attempts"]:  # (a column an earlier version of the stage did not write: shown as -)
        failure = f", reason {a['failure']['reason']}" if a.get("failure") else ""
        lines.append(f"  {a['attempt']}{' (judged)' if a['judged'] else ''}: ok {_yes(a['ok'])}, error "
                     f"{a.get('error') or '-'}{failure}, backend ok {_yes(a.get('backend_ok'))} "
                     f"({a.get('backend_detail') or '-'}), {_or_dash(a.get('n_actions'))} steps, {a['dir']}")  # fmt: skip
    lines += [f"  reject: {r['message']}" for r in s["rejects"]]
    lines += _trajectory_lines(s.get("trajectory")) + _verdict_lines(s.get("verdict"))
    for p in s["dpo_pairs"]:
        lines.append(f"DPO pair: chosen attempt {p['chosen_attempt']}, rejected attempt {p['rejected_attempt']} "
                     f"({_or_dash(p.get('rejected_stage'))}: {_or_dash(p.get('rejected_reason'))})")  # fmt: skip
    for label in s["labels"]:
        said = {True: "success", False: "failure"}.get(label["success"], "unsure")
        lines.append(f"label: {said} on {label['dir'] or '?'}, by {label['labeler'] or '?'} at {label['labeled_at'] or '?'}"
                     + (f": {label['note']}" if label.get("note") else "")
                     + ("" if label["current"] else " (replaced by a later label)"))  # fmt: skip
    return lines


def _trajectory_lines(t: dict | None) -> list[str]:
    if not t:
        return []
    lines = ["judged trajectory:"] + ([f"  ({t['problem']})"] if t.get("problem") else [])
    lines += [f"  step {i}: {json.dumps(step, ensure_ascii=False)}" for i, step in enumerate(t["steps"], 1)]
    if t.get("steps_not_shown"):
        lines.append(f"  ({t['steps_not_shown']:,} more steps in trajectory.json, not shown)")
    lines += [f"  screenshot: {name}" for name in t["screenshots"]]
    text = str(t.get("page_text") or "")
    cut = " …" if len(text) > PAGE_TEXT_CHARS else ""  # (a text the story cut already says how much it left out)
    return lines + [f"  final URL: {t.get('final_url') or '-'}", f"  page text: {text[:PAGE_TEXT_CHARS]}{cut}"]


def _verdict_lines(v: dict | None) -> list[str]:
    from filter_pipeline.rules.schemas import SCORE_RANGE, VERDICT_FLAGS

    if not v:
        return []
    outcome = {True: "passed", False: "failed"}.get(v.get("passed"), v.get("status"))
    judge = " ".join(str(v[k]) for k in ("judge", "model", "prompt_version") if v.get(k)) or "-"
    lines = [f"verdict: {outcome} (votes {v.get('votes') or '-'}, judge {judge})", f"  why: {v.get('why') or '-'}"]
    parts = [f"{p} {_yes(v[p])}" for p in VERDICT_FLAGS if v.get(p) is not None]
    if v.get("score") is not None:
        parts.append(f"score {v['score']}/{SCORE_RANGE[1]}")
    if parts:
        lines.append("  parts: " + ", ".join(parts))
    if v.get("reasoning"):
        lines.append(f"  reasoning: {v['reasoning']}")
    lines.append(f"  tokens: {v.get('prompt_tokens') or 0} prompt ({v.get('cached_tokens') or 0} cached), "
                 f"{v.get('completion_tokens') or 0} completion; cost {v.get('cost') if v.get('cost') is not None else '-'}")  # fmt: skip
    return lines
