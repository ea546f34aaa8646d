"""The per-batch driver of the LLM judge: from the attempts to judge to one verdict row each.

- Prompts are built lazily, off the event loop (reading trajectory files is blocking IO), and at most
  `2 x concurrency` prompts are built and not yet answered at any time: memory does not grow with the batch.
- A prompt whose cache key was already answered (the previous materialization, saved progress) is not
  asked; identical prompts within the batch are asked once, the verdict copied (`deduplicated`).
- Verdicts are saved as they arrive, every `save_every` verdicts or `save_every_seconds`, as Parquet parts
  in a progress folder; a killed run's next materialization reuses them by cache key.
- `EndpointRefused` from the client stops everything: what was answered is saved, then it propagates.

No Dagster here: the resource passes in the client, the progress store and a logger.
"""

import asyncio
import logging
import re
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
from upath import UPath

from filter_pipeline.judge import prompt as judge_prompt
from filter_pipeline.rules.batch import EXECUTIONS_FILE
from filter_pipeline.rules.schemas import JUDGE_PROGRESS_SCHEMA, STATUS_JUDGED, pylist, read_parquet_file

# the verdict fields a fresh answer fills, reused verdicts carry and deduplicated copies share
VERDICT_FIELDS = ("passed", "why", "votes", "status", "requests", "prompt_tokens", "completion_tokens",
                  "cached_tokens", "latency_ms", "raw_replies", "replies_sha256", "success", "side_effects",
                  "looping", "blocked", "score", "key_points", "reasoning")  # fmt: skip
SPEND_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms")  # 0 on copies
REQUEST_COLUMNS = ("instruction", "macro", "site", "dedup_key", "start_kind", "dir", "attempt_line")
MAX_READERS = 8  # threads building prompts (reading trajectory files)


@dataclass(frozen=True)
class Prices:
    """Price per million tokens; all zero: not priced. Cached tokens are part of the prompt tokens and cost
    `cached` instead of `prompt` (None: the prompt price)."""

    prompt: float = 0.0
    completion: float = 0.0
    cached: float | None = None

    @property
    def priced(self) -> bool:
        return bool(self.prompt or self.completion or self.cached)

    def cost(self, prompt_tokens, completion_tokens, cached_tokens):
        """Cost of the given token counts (numbers or arrays); None when not priced."""
        if not self.priced:
            return None
        cached_price = self.prompt if self.cached is None else self.cached
        fresh = np.maximum(np.asarray(prompt_tokens, dtype=float) - cached_tokens, 0)
        return (fresh * self.prompt + np.asarray(cached_tokens, dtype=float) * cached_price
                + np.asarray(completion_tokens, dtype=float) * self.completion) / 1e6  # fmt: skip


class RecordSteps:
    """The `steps` of executions.jsonl records by line number (1-based), for attempts whose trajectory.json
    cannot be used. The file's line offsets are found once, on first use, a slice at a time; each record is
    then read on its own. Safe to call from several threads."""

    CHUNK = 8 << 20

    def __init__(self, run_dir: UPath):
        self.path = run_dir / EXECUTIONS_FILE
        self._starts: np.ndarray | None = None
        self._lock = threading.Lock()

    def _line_starts(self) -> np.ndarray:
        with self._lock:
            if self._starts is None:
                ends, offset = [], 0
                with self.path.open("rb") as f:
                    while chunk := f.read(self.CHUNK):
                        ends.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + offset)
                        offset += len(chunk)
                self._starts = np.concatenate([[0], *(e + 1 for e in ends), [offset + 1]]).astype(np.int64)
            return self._starts

    def __call__(self, line: int) -> list:
        import json

        starts = self._line_starts()
        if not 1 <= line < len(starts):
            return []
        with self.path.open("rb") as f:
            f.seek(int(starts[line - 1]))
            raw = f.read(int(starts[line] - starts[line - 1]))
        try:
            steps = json.loads(raw).get("steps")
        except (ValueError, AttributeError):
            return []
        return steps if isinstance(steps, list) else []


@dataclass
class ProgressStore:
    """Parquet parts of verdicts saved as they arrive, in `folder` (warehouse/_judge_progress/<run_id>/).
    `write(table, path)` writes one part atomically (one PUT on object stores)."""

    folder: UPath
    write: Callable[[pa.Table, UPath], object]
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # this materialization's parts
    _seq: int = 0
    loaded: list = field(default_factory=list)  # parts read at the start
    written: list = field(default_factory=list)  # parts this materialization wrote

    def load(self, log: logging.Logger) -> pd.DataFrame | None:
        """Every saved part's verdicts; a part that cannot be read is skipped with a warning."""
        try:
            paths = sorted(self.folder.glob("*.parquet"), key=lambda p: p.name) if self.folder.exists() else []
        except OSError:
            paths = []
        frames = []
        for path in paths:
            try:
                with path.open("rb") as f:
                    frames.append(read_parquet_file(f).to_pandas())
                self.loaded.append(path)
            except (OSError, ValueError, pa.ArrowException) as exc:
                log.warning(f"judge progress part {path} skipped: it cannot be read ({type(exc).__name__})")
        return pd.concat(frames, ignore_index=True) if frames else None

    def save(self, table: pa.Table) -> None:
        self._seq += 1
        path = self.folder / f"{self.token}-{self._seq:06d}.parquet"
        self.write(table, path)
        self.written.append(path)

    def remove(self) -> int:
        """Remove the parts read at the start and written since (their verdicts are in judge_verdicts now)."""
        removed = 0
        for path in [*self.loaded, *self.written]:
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        self.loaded, self.written = [], []
        try:
            if self.folder.exists() and not any(self.folder.iterdir()):
                self.folder.rmdir()
        except OSError:
            pass  # another materialization's parts arrived meanwhile, or the store has no folders
        return removed


@dataclass
class DriveStats:
    """What one materialization did; `peak_outstanding` is the most prompts built and not yet answered."""

    asked: int = 0
    reused: int = 0
    resumed: int = 0  # of `reused`, from saved progress
    deduplicated: int = 0
    outstanding: int = 0
    peak_outstanding: int = 0
    parts_saved: int = 0
    latencies_ms: array = field(default_factory=lambda: array("d"))


@dataclass
class DriveResult:
    frame: pd.DataFrame  # one row per request, in order: cache_key, evidence, cached, deduplicated, VERDICT_FIELDS
    stats: DriveStats


# A verdict the model passed with a score below FILTER_JUDGE_MIN_SCORE fails, its why saying so: the model's own
# verdict is recovered from it when the verdict is reused, so the threshold can change without a new request.
BELOW_MIN_SCORE = "score {score} is below the minimum score {min_score} (FILTER_JUDGE_MIN_SCORE); the judge: {why}"
_BELOW_MIN_SCORE = re.compile(
    re.escape(BELOW_MIN_SCORE)
    .replace(r"\{score\}", r"\d+")
    .replace(r"\{min_score\}", r"\d+")
    .replace(r"\{why\}", "(.*)"),
    re.DOTALL,
)


def apply_min_score(frame: pd.DataFrame, min_score: int | None) -> tuple[pd.DataFrame, int]:
    """(`frame` with each passing verdict whose score is below `min_score` failed, its why saying so; how many).
    A verdict without a score is left as it is."""
    if min_score is None or frame.empty:
        return frame, 0
    score = pd.to_numeric(frame["score"], errors="coerce")
    below = ((frame["passed"] == True) & (score < min_score)).fillna(False).to_numpy(dtype=bool)  # noqa: E712
    if not below.any():
        return frame, 0
    frame = frame.copy()
    frame["passed"] = frame["passed"].astype(object)
    frame.loc[below, "passed"] = False
    frame.loc[below, "why"] = [
        BELOW_MIN_SCORE.format(score=int(s), min_score=min_score, why=w)
        for s, w in zip(score[below], frame.loc[below, "why"])
    ]
    return frame, int(below.sum())


def model_verdicts(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with the model's own verdict in place of one failed by apply_min_score."""
    found = [_BELOW_MIN_SCORE.fullmatch(w) if isinstance(w, str) else None for w in frame["why"].tolist()]
    hit = np.array([m is not None for m in found], dtype=bool)
    if not hit.any():
        return frame
    frame = frame.copy()
    frame["passed"] = frame["passed"].astype(object)
    frame.loc[hit, "passed"] = True
    frame.loc[hit, "why"] = [m.group(1) for m in found if m is not None]
    return frame


def reusable_verdicts(previous: pd.DataFrame | None, progress: pd.DataFrame | None) -> tuple[pd.DataFrame, int]:
    """(judged verdicts by cache_key, from the previous judge_verdicts and the saved progress parts; how many
    of them only the progress holds). Unjudged ones are asked again; a task that was asked wins over a copy."""
    frames = []
    for source, frame in (("previous", previous), ("progress", progress)):
        if frame is None or frame.empty or "cache_key" not in frame:
            continue
        frame = frame.rename(columns={"calls": "requests"}) if "requests" not in frame else frame
        judged = frame[(frame["status"] == STATUS_JUDGED) & frame["cache_key"].notna()]
        copy = judged["deduplicated"].fillna(False).astype(bool) if "deduplicated" in judged else False
        frames.append(judged.reindex(columns=["cache_key", *VERDICT_FIELDS]).assign(_source=source, _copy=copy))
    if not frames:
        return pd.DataFrame(columns=["cache_key", *VERDICT_FIELDS, "_source"]), 0
    every = pd.concat(frames, ignore_index=True).sort_values("_copy", kind="stable")
    every = model_verdicts(every.drop_duplicates("cache_key").drop(columns="_copy").reset_index(drop=True))
    return every, int((every["_source"] == "progress").sum())


def drive(
    requests: pd.DataFrame,
    client_factory: Callable[[], object],
    concurrency: int,
    data_root: UPath,
    record_steps: Callable[[int], list],
    prompt_settings: judge_prompt.PromptSettings,
    judge_identity: Sequence,
    reusable: pd.DataFrame,
    progress: ProgressStore | None = None,
    save_every: int = 500,
    save_every_seconds: float = 30.0,
    redact: Callable[[str | None], str | None] = lambda text: text,
    log: logging.Logger | None = None,
    build: Callable = judge_prompt.messages_for_attempt,
) -> DriveResult:
    """Verdicts for `requests` (rows of rules.attempts_to_judge), in order. `client_factory()` gives an async
    context manager with `async judge(messages) -> TaskVerdict`. Raises EndpointRefused (after saving what
    was answered); never raises for other endpoint trouble (those tasks get status error)."""
    driver = _Driver(requests, concurrency, data_root, record_steps, prompt_settings, judge_identity, reusable,
                     progress, save_every, save_every_seconds, redact, log or logging.getLogger(__name__), build)  # fmt: skip
    asyncio.run(driver.run(client_factory))
    return DriveResult(driver.frame(), driver.stats)


class _Driver:
    def __init__(self, requests, concurrency, data_root, record_steps, prompt_settings, judge_identity, reusable,
                 progress, save_every, save_every_seconds, redact, log, build):  # fmt: skip
        self.n = n = len(requests)
        self.columns = {c: pylist(requests[c]) if c in requests else [None] * n for c in REQUEST_COLUMNS}
        self.concurrency = max(1, concurrency)
        self.data_root, self.record_steps, self.build = data_root, record_steps, build
        self.prompt_settings, self.judge_identity = prompt_settings, list(judge_identity)
        self.reusable = reusable
        self.reusable_at = {k: i for i, k in enumerate(reusable["cache_key"].tolist())}
        self.from_progress = (
            (reusable["_source"] == "progress").to_numpy() if "_source" in reusable else np.zeros(len(reusable), bool)
        )
        self.progress, self.save_every, self.save_every_seconds = progress, max(1, save_every), save_every_seconds
        self.redact, self.log = redact, log
        self.keys: list = [None] * n
        self.evidence: list = [None] * n
        self.source = np.zeros(n, dtype=np.int8)  # 0 asked, 1 reused (ref: reusable row), 2 copy (ref: task)
        self.ref = np.full(n, -1, dtype=np.int64)
        self.fresh = {f: [None] * n for f in VERDICT_FIELDS}
        self.stats = DriveStats()
        self.leaders: dict[str, int] = {}
        self._unsaved: list[int] = []
        self._last_save = time.monotonic()
        self._saves: list[asyncio.Future] = []
        self._done = 0
        self._report_every = max(1, n // 10)

    # --- the loop -----------------------------------------------------------------------------------

    async def run(self, client_factory) -> None:
        if self.n == 0:
            return
        readers = min(MAX_READERS, 2 * self.concurrency, self.n)
        self.slots = asyncio.Semaphore(2 * self.concurrency)
        self.next_task = iter(range(self.n))
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(readers, thread_name_prefix="judge-prompts") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="judge-progress") as saver:  # fmt: skip
            self.pool, self.saver, self.loop = pool, saver, loop
            try:
                async with client_factory() as client:
                    self.client = client
                    try:
                        async with asyncio.TaskGroup() as group:
                            self.group = group
                            for _ in range(readers):
                                group.create_task(self._reader())
                    except* BaseException as failure:  # the first error, as itself (EndpointRefused: one line)
                        raise failure.exceptions[0] from None
            finally:
                self._save(force=True)
                if self._saves:
                    await asyncio.gather(*self._saves, return_exceptions=True)
                for saved in self._saves:  # a part that failed to save is logged, not fatal
                    if saved.exception() is not None:
                        self.log.warning(f"judge progress could not be saved: {saved.exception()}")

    def _prepare(self, i: int) -> tuple[list[dict], str, str]:
        """In a reader thread: the prompt of task i, its evidence, its cache key."""
        row = {c: values[i] for c, values in self.columns.items()}
        line = row["attempt_line"]
        messages, evidence = self.build(
            self.data_root, row, lambda: self.record_steps(int(line)) if line is not None else [], self.prompt_settings
        )
        return messages, evidence, judge_prompt.cache_key(messages, self.prompt_settings, self.judge_identity)

    async def _reader(self) -> None:
        for i in self.next_task:  # one iterator shared by the readers: each task is taken once
            await self.slots.acquire()
            self._took_slot()
            try:
                messages, evidence, key = await self.loop.run_in_executor(self.pool, self._prepare, i)
            except BaseException:
                self._free_slot()
                raise
            self.keys[i], self.evidence[i] = key, evidence
            if key in self.reusable_at:
                self.source[i], self.ref[i] = 1, self.reusable_at[key]
                self.stats.reused += 1
                self.stats.resumed += int(self.from_progress[self.ref[i]])
            elif key in self.leaders:  # the same prompt is (being) asked for another task: copy its verdict
                self.source[i], self.ref[i] = 2, self.leaders[key]
                self.stats.deduplicated += 1
            else:
                self.leaders[key] = i
                self.group.create_task(self._ask(i, messages))
                continue
            self._free_slot()
            self._resolved()

    async def _ask(self, i: int, messages: list[dict]) -> None:
        try:
            verdict = await self.client.judge(messages)
        finally:
            del messages
            self._free_slot()
        self.stats.asked += 1
        for name in VERDICT_FIELDS:
            self.fresh[name][i] = getattr(verdict, name)
        self.fresh["why"][i] = self.redact(verdict.why)
        self.fresh["raw_replies"][i] = self.redact(verdict.raw_replies)
        self.stats.latencies_ms.extend(verdict.call_latencies_ms)
        if verdict.status == STATUS_JUDGED:
            self._unsaved.append(i)
            self._save()
        self._resolved()

    def _took_slot(self) -> None:
        self.stats.outstanding += 1
        self.stats.peak_outstanding = max(self.stats.peak_outstanding, self.stats.outstanding)

    def _free_slot(self) -> None:
        self.stats.outstanding -= 1
        self.slots.release()

    def _resolved(self) -> None:
        self._done += 1
        if self._done % self._report_every == 0 or self._done == self.n:
            s = self.stats
            self.log.info(
                f"judged {self._done}/{self.n} tasks (asked {s.asked}, reused {s.reused}, deduplicated {s.deduplicated})"
            )

    def _save(self, force: bool = False) -> None:
        """Hand the unsaved verdicts to the saver thread when N of them wait or S seconds have passed."""
        if self.progress is None or not self._unsaved:
            return
        due = len(self._unsaved) >= self.save_every or time.monotonic() - self._last_save >= self.save_every_seconds
        if not (due or force):
            return
        rows, self._unsaved, self._last_save = self._unsaved, [], time.monotonic()
        columns = {"cache_key": [self.keys[i] for i in rows]}
        columns.update(
            {name: [self.fresh[name][i] for i in rows] for name in JUDGE_PROGRESS_SCHEMA.names if name != "cache_key"}
        )
        table = pa.table(columns, schema=JUDGE_PROGRESS_SCHEMA)
        self.stats.parts_saved += 1
        self._saves.append(self.loop.run_in_executor(self.saver, self.progress.save, table))

    # --- the result ---------------------------------------------------------------------------------

    def _first_tasks_lead(self) -> None:
        """Make the first task (in request order) of each group of identical prompts the one that carries the
        request and its cost, whichever reader thread happened to build its prompt first: the same batch gives
        the same rows every time."""
        groups: dict[int, list[int]] = {}
        for i in np.flatnonzero(self.source == 2).tolist():
            groups.setdefault(int(self.ref[i]), []).append(i)
        for leader, followers in groups.items():
            first = min(followers)
            if first > leader:
                continue
            for name in VERDICT_FIELDS:
                self.fresh[name][first] = self.fresh[name][leader]
            self.source[first], self.source[leader] = 0, 2
            for i in [leader, *followers]:
                self.ref[i] = first

    def frame(self) -> pd.DataFrame:
        """One row per request: the verdict fields, asked, reused or copied, with cache_key and evidence."""
        self._first_tasks_lead()
        reused = np.flatnonzero(self.source == 1)
        copies = np.flatnonzero(self.source == 2)
        out = {"cache_key": self.keys, "evidence": self.evidence,
               "cached": self.source == 1, "deduplicated": self.source == 2}  # fmt: skip
        for name in VERDICT_FIELDS:
            values = np.empty(self.n, dtype=object)
            values[:] = self.fresh[name]
            self.fresh[name] = None  # (the lists go as their columns are built: no second copy of the batch)
            if len(reused):
                on_file = self.reusable[name].astype(object)
                # a number missing from an older file reads as NaN: None, as in a fresh verdict
                values[reused] = on_file.where(on_file.notna(), None).to_numpy()[self.ref[reused]]
            if len(copies):
                values[copies] = 0 if name in SPEND_FIELDS else values[self.ref[copies]]
            out[name] = values
        return pd.DataFrame(out, copy=False)
