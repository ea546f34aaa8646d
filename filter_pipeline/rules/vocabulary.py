"""The stage's words for why a row is where it is: failure-pool reasons and stages, surplus' dropped reasons,
verdict statuses and the gate's fixed texts. Written once here; the column descriptions, the schemas and every
rule read them from here."""

# CONTRACT §3.1: error prefix (case-sensitive) -> failure-pool reason, checked in this order.
ERROR_PREFIX_REASONS: tuple[tuple[str, str], ...] = (
    ("policy violation", "policy_violation"),
    ("backend check failed", "backend_fail"),
    ("assertion failed", "script_assert"),
    ("action refused", "action_refused"),
)
REASON_SCRIPT_ERROR = "script_error"  # any other non-empty error
REASON_UNKNOWN = "unknown"  # empty, null or absent error
REASON_JUDGE_FAIL = "judge_fail"
FAILURE_REASONS: tuple[str, ...] = (
    *(reason for _, reason in ERROR_PREFIX_REASONS),
    REASON_SCRIPT_ERROR,
    REASON_UNKNOWN,
    REASON_JUDGE_FAIL,
)
STAGE_EXECUTE = "execute"
STAGE_JUDGE = "judge"
# failure_pool.detail of a verdict the model passed but FILTER_JUDGE_MIN_SCORE failed
BELOW_MIN_SCORE_DETAIL = "score {score} is below the minimum score (FILTER_JUDGE_MIN_SCORE); the judge: {why}"

DROPPED_DUPLICATE = "duplicate"
DROPPED_SITE_CAP = "site_cap"
DROPPED_TARGET = "target"
DROPPED_REASONS: tuple[str, ...] = (DROPPED_DUPLICATE, DROPPED_SITE_CAP, DROPPED_TARGET)

# Judge verdict status: "judged" verdicts count; "error" ones (endpoint down, no parseable majority) are
# neither kept nor failures and are judged again on the next materialization.
STATUS_JUDGED = "judged"
STATUS_ERROR = "error"

GATE_WHY = "deterministic gate only (no LLM judge)"
GATE_VOTES = "gate"
