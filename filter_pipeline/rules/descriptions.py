"""What each output column means, shown beside it in the UI, the limits those texts name, and how any message
is put on one line."""

import pandas as pd

from filter_pipeline.rules.vocabulary import (
    DROPPED_DUPLICATE,
    DROPPED_SITE_CAP,
    DROPPED_TARGET,
    ERROR_PREFIX_REASONS,
    GATE_VOTES,
    REASON_JUDGE_FAIL,
    REASON_SCRIPT_ERROR,
    REASON_UNKNOWN,
    STAGE_EXECUTE,
    STAGE_JUDGE,
    STATUS_ERROR,
    STATUS_JUDGED,
)
from filter_pipeline.settings import JUDGE_GATE, JUDGE_LLM

# judge_verdicts.reasoning: the model's reasoning is kept up to this many characters
REASONING_MAX_CHARS = 8000
RAW_REPLY_MAX_CHARS = 500  # judge_verdicts.raw_replies: each reply cut to this many characters
DETAIL_MAX_CHARS = 500  # failure_pool.detail of an execute row: the error text cut to this many characters
RAW_MAX_CHARS = 4096  # batch_rejects.raw: how much of a rejected line is kept
# judge_calibration rows resting on fewer labels are flagged in its markdown
CALIBRATION_MIN_LABELS = 50


def one_line(text: object, max_chars: int | None = None) -> str:
    """`text` as one line: its whitespace runs (newlines included) made single spaces; cut to `max_chars`."""
    return " ".join(str(text).split())[:max_chars]


def markdown_cell(value: object) -> str:
    """`value` as the text of one markdown table cell: on one line (`one_line`), its `|` escaped (a bare one would
    end the cell and shift the rest of the row); empty for a null."""
    return "" if pd.isna(value) else one_line(value).replace("|", "\\|")


def markdown_table(frame: pd.DataFrame) -> str:
    """`frame` as a markdown table for the UI, a row per row, each cell a `markdown_cell` (names from the data,
    a site holding `|` among them, cannot shift a row's cells)."""
    header = "| " + " | ".join(map(markdown_cell, frame.columns)) + " |"
    rule = "|" + "---|" * len(frame.columns)
    body = ["| " + " | ".join(map(markdown_cell, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body])


def _backend_ok(when_absent: str) -> str:
    return (
        f"The backend check's own `ok` on the attempt ({when_absent}). A failed attempt with backend_ok true "
        "reached the goal anyway: not a clean DPO negative."
    )


# What each column means, shown beside it in the UI (every asset's `dagster/column_schema`). One entry per
# column name: a name means the same thing in every asset that has it. A new column needs its line here.
COLUMN_DESCRIPTIONS: dict[str, str] = {
    # the task and its attempt
    "run_id": "The execution batch (folder runs/<run_id>/) this row belongs to.",
    "task_id": "The task's id, unique within its run (tasks.jsonl).",
    "macro": "The task template the generator made the task from; per-macro caps and targets apply to it.",
    "site": "The website the task runs on.",
    "instruction": "The natural-language instruction the agent was given.",
    "start_kind": "How the task starts: the `kind` of the task's `start` object.",
    "dedup_key": "The dedup key as canonical JSON text of [site, target element, argument] (compact, no "
    'ASCII escaping): keys compare as this text, so 1, "1", 1.0 and true are different arguments.',
    "key_hash": "64-bit BLAKE2b fingerprint of the dedup_key text (signed int64): a cheap probe into history, "
    "always confirmed on the text itself.",
    "attempt": "The attempt number (executions.jsonl `attempt`); the judged attempt is a task's highest ok one.",
    "dir": "The attempt's trajectory folder, relative to the data root (holds trajectory.json, screenshots).",
    "n_actions": "Number of actions (steps) in the attempt.",
    "ok": "Whether the attempt passed the deterministic backend gate (the script's own assertion, re-checked).",
    "error": "The attempt's error text as recorded (null when the attempt has none).",
    "backend_ok": _backend_ok("false when absent"),
    "backend_detail": "The backend check's detail text on the attempt (null when absent).",
    "line": "1-based line number of the record in its file (tasks.jsonl or executions.jsonl).",
    # rejects
    "file": "The batch file the rejected record is in: tasks.jsonl or executions.jsonl.",
    "field": "The field that was wrong (e.g. dedup_key, backend.ok); null when the whole line was (not JSON, "
    "not UTF-8, too long).",
    "message": "What was wrong, as one line 'file:line: reason'.",
    "raw": f"The rejected line as read, cut to {RAW_MAX_CHARS:,} characters.",
    # verdicts
    "passed": "The judge's verdict: true passes, false fails; null when the task could not be judged. For the "
    "LLM judge: judge_passed, failed where the score is below FILTER_JUDGE_MIN_SCORE.",
    "why": "The judge's reason for its verdict (for an unjudged task: why no verdict was reached).",
    "votes": "How the verdict was reached: 'P/N' (P passing votes of N asked) for the LLM judge, "
    f"'{GATE_VOTES}' for the deterministic gate alone; null on execute rows of failure_pool and on unjudged tasks.",
    "backend": "The backend check's detail text on the judged attempt.",
    "status": f"{STATUS_JUDGED} (the verdict counts) or {STATUS_ERROR} (could not be judged: neither kept nor a "
    "failure, judged again later).",
    "judge": f"Which judge decided: {JUDGE_GATE} or {JUDGE_LLM}.",
    "model": "The LLM that judged (null for the gate).",
    "prompt_version": "Version of the judge prompt; part of the verdict cache key (null for the gate).",
    # the verdict's parts
    "judge_passed": "The LLM judge's own verdict (the majority of its votes), before FILTER_JUDGE_MIN_SCORE: "
    "passed is this, failed where the score is below the minimum. Stored so that changing the minimum and "
    "materializing again re-derives passed without a request. Null for the gate and unjudged tasks.",
    "success": "The judge's answer to 'is the task's goal reached?' (prompt v3); null for the gate, an unjudged "
    "task, or a reply that did not say. With several votes: the majority of the votes that said (a tie: null).",
    "side_effects": "The judge's answer to 'did the agent do something beyond the task?' (v3; null as for success).",
    "looping": "The judge's answer to 'did the agent repeat actions without progress, or stop midway?' (v3; null "
    "as for success).",
    "blocked": "The site, not the agent, prevented the task (a CAPTCHA, a bot wall, the site down, an error page "
    "the agent did not cause, a login it was not given): not the agent's mistake, so never a DPO negative. "
    "judge_verdicts: the judge's answer (v3; null as for success); failure_pool: the judge row's, null on "
    "execute rows.",
    "score": "The judge's grade of the attempt, 1 (nothing or the wrong thing done) to 5 (done cleanly); with "
    "several votes the median. With FILTER_JUDGE_MIN_SCORE set, a verdict whose score is below it does not pass. "
    "Null for the gate and where the model gave none.",
    "key_points": "JSON list of the key points the judge said the final state must show (v3), from the vote "
    "whose why the verdict carries; null for the gate.",
    "reasoning": f"The judge's reasoning in full, up to {REASONING_MAX_CHARS:,} characters: the reply's "
    "`reasoning` field, else its text (reasoning blocks included) before the verdict; from the vote whose why "
    "the verdict carries. Null for the gate.",
    "cache_key": "Hash of prompt version, model, votes, temperature and the exact messages shown: a verdict "
    "with the same key is reused, not asked again.",
    "cached": "Whether the verdict was reused (no call made): from this partition's previous materialization or "
    "from the progress a killed materialization saved.",
    "latency_ms": "Wall time spent on this verdict's calls, in milliseconds.",
    "raw_replies": f"JSON list of the model's replies, each cut to {RAW_REPLY_MAX_CHARS} characters (the API key "
    "redacted).",
    "replies_sha256": "SHA-256 of the full replies, to tell replies apart beyond the stored cut.",
    # failure pool
    "stage": f"Where the attempt failed: {STAGE_EXECUTE} (the attempt's ok was false) or {STAGE_JUDGE} (the judge "
    "did not pass it).",
    "reason": f"Why it failed: {', '.join(reason for _, reason in ERROR_PREFIX_REASONS)}, {REASON_SCRIPT_ERROR} or "
    f"{REASON_UNKNOWN} (by the error's prefix, execute rows), {REASON_JUDGE_FAIL} (judge rows).",
    "detail": f"Execute rows: the error text cut to {DETAIL_MAX_CHARS} characters, '' when there is none; judge "
    "rows: the why "
    "(prefixed 'score S is below the minimum score (FILTER_JUDGE_MIN_SCORE)' where the model passed it).",
    # ledger
    "dropped": f"Why a passing verdict was not kept: {DROPPED_DUPLICATE} (key kept before), {DROPPED_SITE_CAP} "
    f"((macro, site) full) or {DROPPED_TARGET} (macro total reached), checked in that order.",
    "dup_of_run_id": "For a duplicate: the run that kept the key first (null otherwise).",
    "dup_of_task_id": "For a duplicate: the task that kept the key first (null otherwise).",
    "n_kept": "Kept rows of this (macro, site) in every other non-retired run.",
    # coverage
    "level": "site (one row per macro and site, against its site cap) or macro (one row per macro, against "
    "its target).",
    "kept": "Kept rows over every non-retired run at this level.",
    "limit": "The site cap (site rows) or the macro target (macro rows; null: no target).",
    "remaining": "How many more kept rows the limit allows (null: no limit).",
    "full": "Whether the limit allows no more kept rows (null: no limit).",
    # judge calibration
    "predictor": "Who is scored against the human labels: judge (one row set per model and prompt_version) or gate.",
    "n": "Labelled attempts scored (the latest label of each attempt; unsure labels, success null, not counted). "
    f"Under {CALIBRATION_MIN_LABELS}, read the intervals rather than the figures.",
    "tp": "True positives: predicted pass, labelled success.",
    "fp": "False positives: predicted pass, labelled failure.",
    "fn": "False negatives: predicted fail, labelled success.",
    "tn": "True negatives: predicted fail, labelled failure.",
    "precision": "tp / (tp + fp): of the predicted passes, the share labelled success (null without a predicted "
    "pass). What a kept row is worth: read it first.",
    "precision_low": "Lower end of precision's Wilson 95% interval.",
    "precision_high": "Upper end of precision's Wilson 95% interval.",
    "recall": "tp / (tp + fn): of the labelled successes, the share predicted to pass.",
    "recall_low": "Lower end of recall's Wilson 95% interval.",
    "recall_high": "Upper end of recall's Wilson 95% interval.",
    "f1": "2 tp / (2 tp + fp + fn): the harmonic mean of precision and recall (null when tp + fp + fn is 0).",
    "kappa": "Cohen's kappa: agreement with the labels beyond what chance gives at the same pass rates (1 "
    "perfect, 0 chance; null when chance alone explains every label).",
    "pass_rate_gap": "The predictor's pass rate minus the labels' success rate, (fp - fn) / n: above 0 the "
    "predictor passes more than it should.",
    "agreement": "(tp + tn) / n: the share of labels the predictor agrees with.",
    # report
    "section": "Part of the report: funnel, site, macro, surplus, cost or caps (the caps the walk used).",
    "key": "What the row is about within its section: a funnel step, a site, a macro, a dropped reason, a "
    "cost figure's name, or for caps a macro with limits of its own or (every other macro).",
    "metric": "The figure's name (e.g. count, keep_rate, a failure reason).",
    "value": "The figure's value.",
    # DPO pairs
    "chosen_dir": "Trajectory folder of the kept attempt (the chosen side).",
    "chosen_attempt": "Attempt number of the kept attempt.",
    "chosen_n_actions": "Actions in the kept attempt.",
    "rejected_dir": "Trajectory folder of the failed attempt (the rejected side).",
    "rejected_attempt": "Attempt number of the failed attempt.",
    "rejected_n_actions": "Actions in the failed attempt.",
    "rejected_stage": f"Where the rejected attempt failed: {STAGE_EXECUTE} or {STAGE_JUDGE}.",
    "rejected_reason": "The rejected attempt's failure-pool reason.",
    "rejected_detail": "The rejected attempt's failure-pool detail.",
    # the LLM judge's cost and evidence
    "deduplicated": "Verdict copied from another task of this batch whose prompt was identical (asked once); "
    "its requests, tokens and cost are 0, the task asked carries them.",
    "requests": "HTTP requests made for this verdict when it was asked (retries included, and the earlier tries "
    "that left the task unjudged; 0 for the gate and for deduplicated copies; a cached verdict carries what it "
    "cost when asked). Its tokens and cost count the same requests.",
    "prompt_tokens": "Prompt tokens the endpoint reported for this verdict's requests (cached tokens included).",
    "completion_tokens": "Completion tokens the endpoint reported for this verdict's requests.",
    "cached_tokens": "Of the prompt tokens, those the endpoint served from its prompt cache.",
    "cost": "Price of this verdict's tokens at the configured FILTER_JUDGE_PRICE_* (per million tokens); null "
    "when no price is set.",
    "evidence": "What the LLM judge was shown: 'trajectory' (the attempt's trajectory.json), or "
    "'record_steps: <why>' (trajectory.json missing, unreadable, not JSON, not an object, outside the data "
    "root: the record's steps, no page text), or 'trajectory, record_steps: <why>' (trajectory.json without a "
    "steps list: its page text, the record's steps). Null for the gate judge, which reads no evidence.",
}

# Where a column means something more, or else, in one asset: shown there instead of COLUMN_DESCRIPTIONS'.
ASSET_COLUMN_DESCRIPTIONS: dict[str, dict[str, str]] = {
    "judge_calibration": {
        "site": "The website the row scores: '(all)' on the overall rows.",
        "model": "The model whose verdicts a judge row scores (null for the gate's rows).",
    },
    "failure_pool": {
        "backend_ok": _backend_ok("false when absent; null on judge rows"),
    },
    "prior_dedup_index": {
        "run_id": "The earlier run that kept this key (history), not this batch.",
        "task_id": "The task of that run that kept this key.",
    },
}


def column_description(asset: str, column: str) -> str | None:
    """What `column` means in `asset`."""
    return ASSET_COLUMN_DESCRIPTIONS.get(asset, {}).get(column) or COLUMN_DESCRIPTIONS.get(column)
