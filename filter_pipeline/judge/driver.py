"""The per-batch driver of the LLM judge: from the attempts to judge to one verdict row each.

- Prompts are built lazily, off the event loop (reading trajectory files is blocking IO), and at most
  `2 x concurrency` prompts are built and not yet answered at any time: memory does not grow with the batch.
- A prompt whose cache key was already answered (the previous materialization, saved progress) is not
  asked; identical prompts within the batch are asked once, the verdict copied (`deduplicated`).
- Verdicts are saved as they arrive, every `save_every_verdicts` or `save_every_seconds`, as Parquet parts
  in a progress folder; a killed run's next materialization reuses them by cache key.
- `EndpointRefused` from the client stops everything: what was answered is saved, then it propagates.

No Dagster here: the resource passes in the client, the progress store and a logger.
"""

import asyncio
import enum
import logging
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
from upath import UPath

from filter_pipeline.judge import prompt as judge_prompt
from filter_pipeline.rules.batch import EXECUTIONS_FILE
from filter_pipeline.rules.records import read_json
from filter_pipeline.rules.schemas import JUDGE_ANSWER_FIELDS, JUDGE_PROGRESS_SCHEMA, SPEND_COUNTS, pylist
from filter_pipeline.rules.vocabulary import STATUS_JUDGED
from filter_pipeline.storage.files import HASH_CHUNK
from filter_pipeline.storage.parquet import read_parquet_file

if TYPE_CHECKING:
    from filter_pipeline.judge.config import LLMJudgeConfig

SPEND_FIELDS = (*SPEND_COUNTS, "latency_ms")  # 0 on deduplicated copies
REQUEST_COLUMNS = ("instruction", "macro", "site", "dedup_key", "start_kind", "dir", "attempt_line")
MAX_READERS = 8  # threads building prompts (reading trajectory files)
MIN_SAVE_SECONDS = 1.0  # the timed save looks no more often than this (FILTER_JUDGE_SAVE_SECONDS may be 0)


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

    def __init__(self, run_dir: UPath):
        self.path = run_dir / EXECUTIONS_FILE
        self._starts: np.ndarray | None = None
        self._lock = threading.Lock()

    def _line_starts(self) -> np.ndarray:
        with self._lock:
            if self._starts is None:
                ends, offset = [], 0
                with self.path.open("rb") as f:
                    while chunk := f.read(HASH_CHUNK):
                        ends.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + offset)
                        offset += len(chunk)
                self._starts = np.concatenate([[0], *(e + 1 for e in ends), [offset + 1]]).astype(np.int64)
            return self._starts

    def __call__(self, line: int) -> list:
        starts = self._line_starts()
        if not 1 <= line < len(starts):
            return []
        with self.path.open("rb") as f:
            f.seek(int(starts[line - 1]))
            raw = f.read(int(starts[line] - starts[line - 1]))
        try:
            steps = read_json(raw).get("steps")
        except (ValueError, AttributeError):
            return []
        return steps if isinstance(steps, list) else []


def progress_parts(folder: UPath) -> list[UPath]:
    """The parts of verdicts saved in `folder` (a `ProgressStore`'s), by name; none when it does not exist."""
    return sorted(folder.glob("*.parquet"), key=lambda p: p.name) if folder.exists() else []


@dataclass
class ProgressStore:
    """Parquet parts of verdicts saved as they arrive, in `folder` (warehouse/_judge_progress/<run_id>/).
    `write(table, path)` writes one part atomically (one PUT on object stores); a store only read needs none."""

    folder: UPath
    write: Callable[[pa.Table, UPath], object] | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # this materialization's parts
    _seq: int = 0
    loaded: list = field(default_factory=list)  # parts read at the start
    written: list = field(default_factory=list)  # parts this materialization wrote

    def load(self, log: logging.Logger, counted: Collection[str] = ()) -> pd.DataFrame | None:
        """Every saved part's verdicts but those of the parts named in `counted` (the previous judge_verdicts was
        built from them: a kill came between its writing and their removal); a part that cannot be read is
        skipped with a warning. `remove` removes every part read or counted."""
        try:
            paths = progress_parts(self.folder)
        except OSError:
            paths = []
        frames = []
        for path in paths:
            if path.name in counted:
                self.loaded.append(path)
                continue
            try:
                with path.open("rb") as f:
                    frames.append(read_parquet_file(f).to_pandas())
                self.loaded.append(path)
            except (OSError, ValueError, pa.ArrowException) as exc:
                log.warning(f"judge progress part {path} skipped: it cannot be read ({type(exc).__name__})")
        return pd.concat(frames, ignore_index=True) if frames else None

    def part_names(self) -> list[str]:
        """The names of the parts read at the start and written since: what verdicts built now were built from."""
        return [path.name for path in (*self.loaded, *self.written)]

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
    unanswered: int = 0  # of `asked`, left unjudged (status error)
    outstanding: int = 0
    peak_outstanding: int = 0
    parts_saved: int = 0
    latencies_ms: array = field(default_factory=lambda: array("d"))


@dataclass
class DriveResult:
    frame: pd.DataFrame  # one row per request, in order: cache_key, evidence, cached, deduplicated, JUDGE_ANSWER_FIELDS
    stats: DriveStats


def passes(frame: pd.DataFrame, min_score: int | None) -> pd.Series:
    """`passed` of each verdict: the model's own (`judge_passed`), failed where its score (when given) is below
    `min_score` (FILTER_JUDGE_MIN_SCORE). Derived at each materialization, so the threshold can change
    without a request; null where the model gave no verdict."""
    passed = frame["judge_passed"].astype(object)
    if min_score is None or frame.empty:
        return passed
    below = (pd.to_numeric(frame["score"], errors="coerce") < min_score).fillna(False).to_numpy(dtype=bool)
    return passed.where(~(below & (passed == True).to_numpy(dtype=bool)), False)  # noqa: E712


def reusable_verdicts(previous: pd.DataFrame | None, progress: pd.DataFrame | None) -> tuple[pd.DataFrame, int]:
    """(judged verdicts by cache_key, from the previous judge_verdicts and the saved progress parts; how many
    of them only the progress holds). Unjudged ones are asked again; a task that was asked wins over a copy."""
    frames = []
    for source, frame in (("previous", previous), ("progress", progress)):
        if frame is None or frame.empty or "cache_key" not in frame:
            continue
        frame = frame.rename(columns={"calls": "requests"}) if "requests" not in frame else frame
        # files written before judge_passed hold the model's verdict in passed
        model = frame["judge_passed"] if "judge_passed" in frame else pd.Series(None, index=frame.index, dtype=object)
        frame = frame.assign(judge_passed=model.astype(object).where(model.notna(), frame.get("passed")))
        judged = frame[(frame["status"] == STATUS_JUDGED) & frame["cache_key"].notna()]
        copy = judged["deduplicated"].fillna(False).astype(bool) if "deduplicated" in judged else False
        frames.append(judged.reindex(columns=["cache_key", *JUDGE_ANSWER_FIELDS]).assign(_source=source, _copy=copy))
    if not frames:
        return pd.DataFrame(columns=["cache_key", *JUDGE_ANSWER_FIELDS, "_source"]), 0
    every = pd.concat(frames, ignore_index=True).sort_values("_copy", kind="stable")
    every = every.drop_duplicates("cache_key").drop(columns="_copy").reset_index(drop=True)
    return every, int((every["_source"] == "progress").sum())


def earlier_spend(
    previous: pd.DataFrame | None, requests: pd.DataFrame, keys: pd.Series, progress: pd.DataFrame | None = None
) -> pd.DataFrame:
    """SPEND_COUNTS of the tries that left each request unjudged before: its row in the previous
    judge_verdicts (same run_id where both name one, task_id, attempt and cache_key `keys`) when that row is
    unjudged, plus the unjudged rows of saved `progress` (a materialization that did not finish) with its
    cache_key, on the first request with that key (the one that asks it); 0 where none. A verdict row
    replaces those rows, so it carries what they cost."""
    spent = pd.DataFrame(0, index=range(len(requests)), columns=list(SPEND_COUNTS), dtype="int64")
    on = ["task_id", "attempt", "cache_key"]
    unjudged = _unjudged_spend(previous)
    if unjudged is not None and {"status", *on} <= set(unjudged):
        left = pd.DataFrame({"task_id": requests["task_id"].to_numpy(), "attempt": requests["attempt"].to_numpy(),
                             "cache_key": keys.to_numpy()})  # fmt: skip
        if "run_id" in requests and "run_id" in unjudged:
            on, left = [*on, "run_id"], left.assign(run_id=requests["run_id"].to_numpy())
        right = unjudged[on].assign(**unjudged[list(SPEND_COUNTS)]).drop_duplicates(on)
        found = left.astype({"attempt": "int64"}).merge(right.astype({"attempt": "int64"}), on=on, how="left")
        spent += found[list(SPEND_COUNTS)].fillna(0).astype("int64").to_numpy()
    saved = _unjudged_spend(progress)
    if saved is not None and "cache_key" in saved:
        per_key = saved.groupby("cache_key")[list(SPEND_COUNTS)].sum()
        first = ~keys.duplicated().to_numpy()
        spent.loc[first] += per_key.reindex(keys[first].to_numpy()).fillna(0).astype("int64").to_numpy()
    return spent


def _unjudged_spend(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """The unjudged rows of a verdicts frame, their SPEND_COUNTS as integers (0 where missing); None without."""
    if frame is None or frame.empty or "status" not in frame:
        return None
    frame = frame.rename(columns={"calls": "requests"}) if "requests" not in frame else frame
    unjudged = frame[frame["status"] != STATUS_JUDGED]
    if unjudged.empty:
        return None
    counts = unjudged.reindex(columns=list(SPEND_COUNTS)).apply(pd.to_numeric, errors="coerce").fillna(0)
    return unjudged.assign(**counts.astype("int64"))


class Source(enum.IntEnum):
    """Where a task's verdict comes from."""

    ASKED = 0  # asked of the endpoint by this materialization
    REUSED = 1  # on file (the previous judge_verdicts, saved progress) under the same cache key
    COPY = 2  # the verdict of an identical prompt asked for another task of the batch


@dataclass
class DriveJob:
    """What one drive needs. `client_factory()` gives an async context manager with
    `async judge(messages) -> TaskVerdict`; `reusable` is reusable_verdicts' frame; `build` makes a task's
    (messages, evidence)."""

    requests: pd.DataFrame  # rows of rules.filtering.attempts_to_judge
    config: "LLMJudgeConfig"
    data_root: UPath
    record_steps: Callable[[int], list]
    reusable: pd.DataFrame
    client_factory: Callable[[], object]
    progress: ProgressStore | None = None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger(__name__))
    build: Callable = judge_prompt.messages_for_attempt


def drive(job: DriveJob) -> DriveResult:
    """Verdicts for `job.requests`, in order. Raises EndpointRefused (after saving what was answered); never
    raises for other endpoint trouble (those tasks get status error)."""
    driver = _Driver(job)
    asyncio.run(driver.run(job.client_factory))
    return DriveResult(driver.frame(), driver.stats)


class _Driver:
    def __init__(self, job: DriveJob):
        self.job, self.config, self.log = job, job.config, job.log
        self.n = n = len(job.requests)
        self.columns = {c: pylist(job.requests[c]) if c in job.requests else [None] * n for c in REQUEST_COLUMNS}
        self.concurrency = max(1, job.config.concurrency)
        self.reusable = job.reusable
        self.reusable_at = {k: i for i, k in enumerate(job.reusable["cache_key"].tolist())}
        self.from_progress = (
            (job.reusable["_source"] == "progress").to_numpy()
            if "_source" in job.reusable
            else np.zeros(len(job.reusable), bool)
        )
        self.keys: list = [None] * n
        self.evidence: list = [None] * n
        self.source = np.full(n, Source.ASKED, dtype=np.int8)
        self.ref = np.full(n, -1, dtype=np.int64)  # REUSED: the reusable row; COPY: the task asked
        self.fresh = {f: [None] * n for f in JUDGE_ANSWER_FIELDS}
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
                            self._ticker = group.create_task(self._save_on_time())
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
        line, job = row["attempt_line"], self.job
        messages, evidence = job.build(
            job.data_root, row, lambda: job.record_steps(int(line)) if line is not None else [], self.config
        )
        return messages, evidence, judge_prompt.cache_key(messages, self.config)

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
            if key in self.leaders:  # the same prompt is (being) asked, or reused, for another task: a copy
                self.source[i], self.ref[i] = Source.COPY, self.leaders[key]
                self.stats.deduplicated += 1
            elif key in self.reusable_at:  # (its cost is counted once, on the task that reuses it)
                self.source[i], self.ref[i] = Source.REUSED, self.reusable_at[key]
                self.leaders[key] = i
                self.stats.reused += 1
                self.stats.resumed += int(self.from_progress[self.ref[i]])
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
        for name in JUDGE_ANSWER_FIELDS:
            self.fresh[name][i] = verdict.passed if name == "judge_passed" else getattr(verdict, name)
        self.stats.latencies_ms.extend(verdict.call_latencies_ms)
        if verdict.status != STATUS_JUDGED:
            self.stats.unanswered += 1
        # (an unjudged one too: never reused, but what it spent is carried by the row that replaces it)
        self._unsaved.append(i)
        self._save()
        self._resolved()

    async def _save_on_time(self) -> None:
        """Save what waits every `save_every_seconds` also while no verdict arrives (an endpoint stalled on a
        long retry): a kill then loses at most that much. Cancelled once every task is resolved."""
        while True:  # (wakes when the oldest unsaved verdict is due, not on a beat of its own)
            due_in = self._last_save + self.config.save_every_seconds - time.monotonic()
            await asyncio.sleep(max(due_in, MIN_SAVE_SECONDS))
            self._save()

    def _took_slot(self) -> None:
        self.stats.outstanding += 1
        self.stats.peak_outstanding = max(self.stats.peak_outstanding, self.stats.outstanding)

    def _free_slot(self) -> None:
        self.stats.outstanding -= 1
        self.slots.release()

    def _resolved(self) -> None:
        self._done += 1
        if self._done == self.n:
            self._ticker.cancel()
        if self._done % self._report_every == 0 or self._done == self.n:
            s = self.stats
            self.log.info(
                f"{self._done}/{self.n} tasks done (asked {s.asked}, of them unjudged {s.unanswered}; "
                f"reused {s.reused}, deduplicated {s.deduplicated})"
            )

    def _save(self, force: bool = False) -> None:
        """Hand the unsaved verdicts to the saver thread when N of them wait or S seconds have passed."""
        progress, config = self.job.progress, self.config
        if progress is None or not self._unsaved:
            return
        due = (
            len(self._unsaved) >= config.save_every_verdicts
            or time.monotonic() - self._last_save >= config.save_every_seconds
        )
        if not (due or force):
            return
        rows, self._unsaved, self._last_save = self._unsaved, [], time.monotonic()
        columns = {"cache_key": [self.keys[i] for i in rows]}
        columns.update(
            {name: [self.fresh[name][i] for i in rows] for name in JUDGE_PROGRESS_SCHEMA.names if name != "cache_key"}
        )
        table = pa.table(columns, schema=JUDGE_PROGRESS_SCHEMA)
        self.stats.parts_saved += 1
        self._saves.append(self.loop.run_in_executor(self.saver, progress.save, table))

    # --- the result ---------------------------------------------------------------------------------

    def _first_tasks_lead(self) -> None:
        """Make the first task (in request order) of each group of identical prompts the one that carries the
        request and its cost, whichever reader thread happened to build its prompt first: the same batch gives
        the same rows every time."""
        groups: dict[int, list[int]] = {}
        for i in np.flatnonzero(self.source == Source.COPY).tolist():
            groups.setdefault(int(self.ref[i]), []).append(i)
        for leader, followers in groups.items():
            first = min(followers)
            if first > leader:
                continue
            if self.source[leader] == Source.REUSED:
                self.ref[first] = self.ref[leader]  # (the verdict's row on file)
            else:
                for name in JUDGE_ANSWER_FIELDS:
                    self.fresh[name][first] = self.fresh[name][leader]
            self.source[first], self.source[leader] = self.source[leader], Source.COPY
            for i in [leader, *followers]:
                if i != first:
                    self.ref[i] = first

    def frame(self) -> pd.DataFrame:
        """One row per request: the verdict fields, asked, reused or copied, with cache_key and evidence."""
        self._first_tasks_lead()
        reused = np.flatnonzero(self.source == Source.REUSED)
        copies = np.flatnonzero(self.source == Source.COPY)
        out = {"cache_key": self.keys, "evidence": self.evidence,
               "cached": self.source == Source.REUSED, "deduplicated": self.source == Source.COPY}  # fmt: skip
        for name in JUDGE_ANSWER_FIELDS:
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
