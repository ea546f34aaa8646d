"""Reading what a chat-completions endpoint replied: the verdict in a model's reply, the choices and token usage
of a completion, and the retry hints of a refused request. Pure functions, no IO.
"""

import bisect
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.rules.schemas import SCORE_RANGE, VERDICT_FLAGS

# Reasoning models write their thinking in such blocks; a verdict-shaped object inside one is the model
# thinking aloud (often quoting the requested format), never its answer.
# Tags as `<think>`, `<seed:think>` (a namespace before the name) or `[THINK]` (Magistral's brackets).
_NAME = r"(?:[\w-]+:)?(?:think|thinking|reasoning)"
_CLOSE_TAG = re.compile(rf"</{_NAME}\s*>|\[/THINK\]", re.IGNORECASE)
# An opening tag is `<name ...>` (up to the first `>` after its name) or `[THINK]`. Where each may start: its
# `<name`, whose `>` is found apart (`_opening_tags`), since a regex would look for it again from every `<name`.
_OPENING = re.compile(rf"<({_NAME})\b|\[(THINK)\]", re.IGNORECASE)
# What may close a block: `</name>` (space before its `>` allowed) or `[/name]`, whatever the name; the names
# are compared with the opening tags' in `_closed_blocks`
_ANY_CLOSE = re.compile(r"</([^\s<>/]+)\s*>|\[/([^\s<>/\[\]]+)\]")
# A namespaced name's own start, when it is a reasoning name too (`<think:think>`): the name a closing tag
# may give instead
_BARE_NAME = re.compile(r"(?:think|thinking|reasoning)\b", re.IGNORECASE)
# A brace of prose (`/cart/{id}`, `\\boxed{0}`) follows a letter, a digit, a slash, a backslash, a brace or a
# dollar and holds no colon, quote or line break before its own `}` (braces of prose nested once are part of
# it); a template's `{{name}}`, which no JSON object starts with, is one anywhere. Any other `{` that does not
# decode is a broken object.
_PROSE_CHAR = r"[^{}:\"'\n\u201c\u201e\u300c\u00ab]"
_PROSE_BRACE = re.compile(
    rf"(?<=[\w/\\{{$])\{{(?:{_PROSE_CHAR}|\{{{_PROSE_CHAR}*\}}){{0,80}}\}}|\{{\{{{_PROSE_CHAR}{{0,80}}\}}\}}"
)


@dataclass(frozen=True)
class Parts:
    """What a v3 reply says beside its verdict; None where the reply does not say it (a v2-shaped reply, a
    value of the wrong type, a score outside SCORE_RANGE)."""

    success: bool | None = None
    side_effects: bool | None = None
    looping: bool | None = None
    blocked: bool | None = None
    score: int | None = None
    key_points: list[str] | None = None
    reasoning: str | None = None  # the reply's `reasoning`, else its own text before the verdict


@dataclass(frozen=True)
class Verdict:
    passed: bool
    why: str
    parts: Parts = field(default_factory=Parts, compare=False)


def strip_reasoning(text: str) -> str:
    """`text` without its reasoning blocks: closed `<think>…</think>` (or thinking/reasoning, namespaced, or
    `[THINK]…[/THINK]`) blocks; everything before a closing tag whose opening tag the chat template already
    sent; all of a reply that starts with a block never closed (cut off while thinking). A tag inside a JSON
    object's string, or after a `{` that does not decode and is no brace of prose (the tag may be in the
    broken object's string), is text, not a tag."""
    text = _without_blocks(text)
    objects, broken = _objects(text)
    closes = [m for m in _CLOSE_TAG.finditer(text) if _is_tag(m.start(), objects, broken)]
    if closes:
        text = text[closes[-1].end() :]
    tags = _opening_tags(text.lstrip())
    return "" if tags and tags[0][0] == 0 else text


def _opening_tags(text: str) -> list[tuple[int, int, str, bool]]:
    """(start, end, name, bracketed) of every opening tag of `text` (one inside another's attributes included),
    in order, found in one pass: each `<name`'s end is the first `>` after it, each `>` looked for once for all
    the `<name`s before it."""
    tags, close = [], -1
    for m in _OPENING.finditer(text):
        if m.group(2) is not None:
            tags.append((m.start(), m.end(), m.group(2), True))
            continue
        if close < m.end():
            close = text.find(">", m.end())
            if close == -1:  # (no `>` after it: no `<name` from here on opens a tag, but a `[THINK]` may)
                close = len(text) + 1
        if close < len(text):
            tags.append((m.start(), close + 1, m.group(1), False))
    return tags


def _outermost(tags: list[tuple[int, int, str, bool]]) -> list[tuple[int, int, str, bool]]:
    """The tags of `_opening_tags` that do not start inside the one before: those a regex's search finds."""
    found, end = [], 0
    for tag in tags:
        if tag[0] >= end:
            found.append(tag)
            end = tag[1]
    return found


def _closed_blocks(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each closed reasoning block, in order, the next searched after the last: an opening tag
    up to the first closing tag after it of its name, case aside (for a namespaced name whose start is a
    reasoning name, `<think:think>`, of that start when the whole name is never closed after it). An opening
    tag never closed after it opens no block. Every closing tag is indexed once, so each opening tag costs a
    lookup: a reply repeating tags it never closes is read in time in proportion to its length."""
    # (bracketed, folded name) -> the (start, end) of its closing tags, in order (`</[think>` closes no `[THINK]`)
    closes: dict[tuple[bool, str], list[tuple[int, int]]] = {}
    for m in _ANY_CLOSE.finditer(text):
        key = (False, _folded(m.group(1))) if m.group(1) else (True, _folded(m.group(2)))
        closes.setdefault(key, []).append(m.span())
    at = 0
    for start, end, name, bracketed in _opening_tags(text):
        if start < at:
            continue
        bare = None if bracketed or ":" not in name else _BARE_NAME.match(name)
        names = [name] if bracketed else [n for n in (name, bare and bare.group(0)) if n]
        for spans in (closes.get((bracketed, _folded(n)), []) for n in names):
            first = bisect.bisect_left(spans, (end, 0))
            if first < len(spans):
                yield start, spans[first][1]
                at = spans[first][1]
                break


def _folded(name: str) -> str:
    """`name` with each character lower case, as a regex's backreference compares them ignoring case (each
    character's simple lower case: the first of its full one)."""
    return "".join(c.lower()[0] for c in name)


def _without_blocks(text: str) -> str:
    objects, broken = _objects(text)
    # (both tags must be tags: a closing one in a JSON string is text)
    return _without(
        text,
        [(a, b) for a, b in _closed_blocks(text) if _is_tag(a, objects, broken) and _is_tag(b - 1, objects, broken)],
    )


def _without(text: str, spans: Iterable[tuple[int, int]]) -> str:
    """`text` without the (start, end) `spans`, which are in order and do not overlap."""
    kept, at = [], 0
    for start, end in spans:
        kept.append(text[at:start])
        at = end
    kept.append(text[at:])
    return "".join(kept)


def _is_tag(at: int, objects: list[tuple[dict, int, int]], broken: int | None) -> bool:
    """Whether a tag at `at` is one: not inside a JSON object, nor after a `{` that starts a broken one."""
    if broken is not None and at >= broken:
        return False
    before = bisect.bisect_left(objects, at, key=lambda o: o[1])  # (objects in order: the last starting before it)
    return before == 0 or not at < objects[before - 1][2]


def parse_reply(text: str | None, cut_off: bool = False) -> Verdict | None:
    """The verdict in a model's reply, once reasoning blocks are removed (`strip_reasoning`): its LAST JSON
    object (bare, in a ```json fence or inside prose) when that object has a boolean `passed`, or is an
    envelope holding one (`_held_verdict`); objects nested in the verdict (criteria) are part of it. An
    object before the last (the answer format quoted) is not the answer. None, so that the reply is repaired,
    when the reply holds no such last object, or which object is its last is not known:
    - a `{` that does not decode and is no brace of prose (`_PROSE_BRACE`: `/cart/{id}`): a trailing comma, a
      raw line break or quote in a string, single quotes, comments. Every `{` after it may be nested in it, so
      a criterion could pass for the broken verdict, and an object before it is not the last;
    - the reply ends inside an object: its last object is unfinished;
    - its last object is listed in an array: one of several, a criterion as likely as a verdict;
    - a reasoning block opens after the reply began and never closes: where it ends is not known;
    - `cut_off` at the token limit with more than closing marks after the verdict object (`_CLOSING`: a fence,
      brackets, a closing tag): still writing, the object was not its last word.
    `why` is optional ("" when absent); other fields are allowed."""
    if not text:
        return None
    thinking = _reasoning_blocks(text)
    text = strip_reasoning(text)
    objects, broken = _objects(text)
    if broken is not None or not objects or any(_is_tag(t[0], objects, None) for t in _outermost(_opening_tags(text))):
        return None
    value, start, end = objects[-1]
    verdict = None if _listed(text, start, end) else _held_verdict(value)
    if verdict is None or cut_off and not _CLOSING.fullmatch(text[end:]):
        return None
    before = "\n\n".join(part for part in (thinking, text[:start].strip()) if part)
    return Verdict(verdict["passed"], _why(verdict.get("why")), read_parts(verdict, before))


def _listed(text: str, start: int, end: int) -> bool:
    """Whether the object at `start`..`end` is listed in an array (`[{...}, {...}]`): one of several, a
    criterion as likely as a verdict. (A comma of prose before it, `Here it is, {...}`, lists nothing.)"""
    before, after = text[:start].rstrip(), text[end:].lstrip()
    return before.endswith(("[", ",")) and after.startswith(("]", ","))


def _objects(text: str) -> tuple[list[tuple[dict, int, int]], int | None]:
    """(the reply's top-level JSON objects before the first broken one, in order, as (it, where it starts, where
    it ends); where the first `{` that does not decode and is no brace of prose is, an object the reply ends
    inside included (what follows may be nested in it); else None). A brace of prose (`_PROSE_BRACE`:
    `/cart/{id}`) is skipped; the objects nested in an object are its own. Each `{` is decoded at most once and
    the search ends at the broken one: a long reply costs time in proportion to its length."""
    decoder = json.JSONDecoder()
    found = []
    i = text.find("{")
    while i != -1:
        prose = _PROSE_BRACE.match(text, i)
        if prose is not None and text[i + 1 : prose.end() - 1].strip(_JSON_WHITESPACE):
            # (no key in it: it never decodes; one holding JSON's whitespace alone, `{ }`, is an empty object)
            i = text.find("{", i + 1)
            continue
        try:
            value, end = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):  # (not JSON there, an integer too long, nesting too deep, cut off)
            return found, i
        if isinstance(value, dict):
            found.append((value, i, end))
        i = text.find("{", end)
    return found, None


_JSON_WHITESPACE = " \t\n\r"


def _held_verdict(value: dict) -> dict | None:
    """`value` when its `passed` is a boolean; else, when `value` is an envelope (an object whose one field is
    an object: `{"verdict": {...}}`), the verdict it holds, through any number of envelopes. None otherwise: a
    wrapper with other fields beside its verdict may list criteria there, each with a `passed` of its own."""
    while "passed" not in value and len(value) == 1 and isinstance(inner := next(iter(value.values())), dict):
        value = inner
    return value if isinstance(value.get("passed"), bool) else None


# What may follow a reply's last object once it is whole: closing marks (a fence, brackets, a tag such as
# `</answer>`), not more of its writing.
_CLOSING = re.compile(r"(?:\s|`|\]|\}|</[A-Za-z][\w.-]*>)*")


def read_parts(value: dict, before: str = "") -> Parts:
    """The parts of a verdict object; `before`: the reply's text ahead of it, the reasoning when the object
    has no `reasoning` text of its own."""
    flags = {name: value.get(name) if isinstance(value.get(name), bool) else None for name in VERDICT_FLAGS}
    score = value.get("score")
    if isinstance(score, float) and score.is_integer():
        score = int(score)
    if not (isinstance(score, int) and not isinstance(score, bool) and SCORE_RANGE[0] <= score <= SCORE_RANGE[1]):
        score = None
    points = value.get("key_points")
    points = [_why(p) for p in points] if isinstance(points, list) else None
    reasoning = value.get("reasoning")
    reasoning = reasoning if isinstance(reasoning, str) and reasoning.strip() else before or None
    return Parts(**flags, score=score, key_points=points, reasoning=reasoning)


def _reasoning_blocks(text: str) -> str:
    """The text of the reply's closed reasoning blocks, without their tags."""
    inners = (_CLOSE_TAG.sub("", text[start:end]) for start, end in _closed_blocks(text))
    inners = (_without(inner, (tag[:2] for tag in _outermost(_opening_tags(inner)))) for inner in inners)
    return "\n\n".join(inner.strip() for inner in inners if inner.strip())


def _why(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:  # (the decoder followed it a few levels deeper than the encoder can)
        return "(nested too deep to show)"


# --- a completion -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    text: str | None  # the message content; reasoning_content / reasoning fields are never read
    finish_reason: str | None
    refusal: str | None = None  # the message's `refusal` text (a model declining a structured answer)
    withheld: str | None = None  # what the completion holds instead of a message: NO_MESSAGE or NO_CHOICES

    @property
    def cut_off(self) -> bool:
        return self.finish_reason == "length"

    @property
    def filtered(self) -> bool:
        """The endpoint's content filter stopped the reply: its text may end anywhere, a verdict in it too."""
        return self.finish_reason == "content_filter"

    @property
    def refused(self) -> bool:
        """The model declined to answer, or the endpoint's content filter stopped it (its message, or the
        whole completion, withheld): asking again for the JSON object would be declined the same way."""
        return self.refusal is not None or self.filtered or self.withheld is not None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reported: bool = True  # False: the completion carried no usage (its tokens count as 0)


NO_MESSAGE = "no message"
NO_CHOICES = "no choices"


def passes_on_a_fault(payload: Any) -> bool:
    """Whether a 2xx body is a chat completion whose choice says the request failed (`finish_reason` `error`: a
    gateway passing on its upstream's fault), retried as any transient fault whatever its message holds."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "error" for c in choices)


def read_completion(payload: Any) -> tuple[list[Choice], Usage] | None:
    """The choices (in index order, at least one) and usage of a chat completion; None when `payload` is not
    one (no `choices` list, or a choice that is neither a chat message nor a choice whose message is null) or
    a choice passes on a fault (`finish_reason` `error`). A
    choice without a message (`"message": null`, as a filtered Azure/OpenAI completion sends) is withheld
    (NO_MESSAGE); so is a completion without any choice (NO_CHOICES: one choice standing for the whole
    request, as Gemini's PROHIBITED_CONTENT and some gateways answer). Both are answers, refused, not faults."""
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        return None
    usage = _usage(payload.get("usage"))
    if not payload["choices"]:
        return [Choice(None, None, withheld=NO_CHOICES)], usage
    choices = []
    if passes_on_a_fault(payload):
        return None
    for c in sorted(payload["choices"], key=_choice_index):
        message = c.get("message") if isinstance(c, dict) else None
        # (`"message": null` only: a choice without the key is another shape)
        if isinstance(c, dict) and "message" in c and message is None:
            choices.append(Choice(None, c.get("finish_reason"), withheld=NO_MESSAGE))
            continue
        if not isinstance(message, dict):
            return None
        refusal = message.get("refusal")
        refusal = refusal if isinstance(refusal, str) and refusal.strip() else None
        choices.append(Choice(_content_text(message.get("content")), c.get("finish_reason"), refusal))
    return choices, usage


def _choice_index(choice: Any) -> int:
    """A choice's `index` where it is a whole number (a server may send none, null or text: then 0, and the
    stable sort keeps the server's order)."""
    index = choice.get("index") if isinstance(choice, dict) else None
    return index if type(index) is int else 0


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return json.dumps(content, ensure_ascii=False)


def _count(value: Any) -> int:
    usable = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf
    return int(value) if usable else 0


def _usage(usage: Any) -> Usage:
    if not isinstance(usage, dict):
        return Usage(reported=False)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached))


def error_message(text: str) -> str:
    """The server's short message from an error body (`{"error": {"message": ...}}`, `{"error": "..."}`,
    `{"message": ...}`, `{"detail": ...}`), else the body itself; one line."""
    message: Any = text
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json follows
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            err = err.get("message") or err.get("detail") or err.get("msg") or err
        try:
            message = err if isinstance(err, str) else json.dumps(err, ensure_ascii=False)
        except RecursionError:
            message = text
    return one_line(message)


# --- retry hints ------------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def duration_seconds(text: str) -> float | None:
    """Seconds in a Go-style duration (`1s`, `6m0s`, `20ms`, `0.5s`, `1h2m3.5s`) or a bare number of seconds."""
    text = text.strip().lower()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        return value if math.isfinite(value) and value >= 0 else None
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def _http_date(text: str | None) -> datetime | None:
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def _seconds_or_date(text: str, now: datetime) -> float | None:
    seconds = duration_seconds(text)
    if seconds is not None:
        return seconds
    when = _http_date(text)
    return None if when is None else max((when - now).total_seconds(), 0.0)


def retry_hint(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds the endpoint asks to wait before the next request, from (first found) `retry-after-ms`,
    `Retry-After` (seconds or an HTTP-date), LiteLLM's `llm_provider-retry-after(-ms)`, else the
    `x-ratelimit-reset-requests` / `x-ratelimit-reset-tokens` (`1s`, `6m0s`, `20ms`) of a limit used up (its
    `x-ratelimit-remaining-*` 0; the longest, when both are). None: no hint (the caller backs off). A reset
    says when its limit is whole again, not when the next request may go: a token budget with tokens left is
    whole again in minutes, while a request may go in a second, or once a few tokens are back.
    An HTTP-date counts from the response's own `Date` (the server's clock, which set it: this machine's
    may be minutes off), else from `now` (this machine's clock)."""
    h = {k.lower(): v for k, v in headers.items()}
    now = _http_date(h.get("date")) or now or datetime.now(UTC)
    for prefix in ("", "llm_provider-"):
        ms = h.get(f"{prefix}retry-after-ms")
        if ms is not None and (seconds := duration_seconds(ms)) is not None:
            return seconds / 1000
        after = h.get(f"{prefix}retry-after")
        if after is not None and (seconds := _seconds_or_date(after, now)) is not None:
            return seconds
    used_up = []
    for name in (f"{p}x-ratelimit-{{}}-{what}" for p in ("", "llm_provider-") for what in ("requests", "tokens")):
        seconds = duration_seconds(h.get(name.format("reset"), ""))
        if seconds is not None and h.get(name.format("remaining"), "").strip() == "0":
            used_up.append(seconds)
    return max(used_up) if used_up else None
