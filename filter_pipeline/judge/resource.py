"""The judge: turns the attempts to judge into verdicts.

`JudgeResource` is what assets see; `kind` picks the implementation, so a new judge plugs in here without
touching an asset. Every implementation returns one verdict row per request, in request order, with
`passed`, `why`, `votes` and `status` (`judged`, or `error` for a task that could not be judged).
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import dagster as dg
import numpy as np
import pandas as pd
from pydantic import Field, field_validator
from upath import UPath

from filter_pipeline.judge import client as llm_judge
from filter_pipeline.judge import driver
from filter_pipeline.judge.prompt import PROMPT_VERSION, PromptSettings
from filter_pipeline.rules.report import agreement_markdown
from filter_pipeline.rules.schemas import (
    EVIDENCE_TRAJECTORY,
    GATE_VOTES,
    GATE_WHY,
    STATUS_ERROR,
    STATUS_JUDGED,
    evidence_kind,
)
from filter_pipeline.settings import JUDGE_KIND_ENV, JUDGE_KINDS

# CONTRACT §8 environment settings of the LLM judge (plus the ones after VOTES, this project's own).
ENV = {
    "kind": JUDGE_KIND_ENV,
    "base_url": "FILTER_JUDGE_BASE_URL",
    "model": "FILTER_JUDGE_MODEL",
    "api_key": "FILTER_JUDGE_API_KEY",
    "votes": "FILTER_JUDGE_VOTES",
    "concurrency": "FILTER_JUDGE_CONCURRENCY",
    "timeout_seconds": "FILTER_JUDGE_TIMEOUT",
    "temperature": "FILTER_JUDGE_TEMPERATURE",
    "max_tokens": "FILTER_JUDGE_MAX_TOKENS",
    "task_budget_seconds": "FILTER_JUDGE_TASK_BUDGET",
    "reasoning_model": "FILTER_JUDGE_REASONING_MODEL",
    "structured_output": "FILTER_JUDGE_STRUCTURED_OUTPUT",
    "prompt_version": "FILTER_JUDGE_PROMPT_VERSION",
    "min_score": "FILTER_JUDGE_MIN_SCORE",
    "include_screenshot": "FILTER_JUDGE_SCREENSHOT",
    "save_every_verdicts": "FILTER_JUDGE_SAVE_EVERY",
    "save_every_seconds": "FILTER_JUDGE_SAVE_SECONDS",
    "price_per_million_prompt_tokens": "FILTER_JUDGE_PRICE_PROMPT",
    "price_per_million_completion_tokens": "FILTER_JUDGE_PRICE_COMPLETION",
    "price_per_million_cached_tokens": "FILTER_JUDGE_PRICE_CACHED",
}


def gate_verdicts(requests: pd.DataFrame) -> pd.DataFrame:
    """The deterministic gate alone: every attempt it is shown already passed the backend gate (`ok`)."""
    return requests.assign(
        passed=True,
        why=GATE_WHY,
        votes=GATE_VOTES,
        status=STATUS_JUDGED,
        judge="gate",
        cached=False,
        deduplicated=False,
        requests=0,
        evidence=None,
    )


@dataclass(frozen=True)
class Judgement:
    verdicts: pd.DataFrame  # the requests plus verdict columns, same rows and order
    metadata: dict  # figures for the judge_verdicts materialization
    written: Callable[[], int] = lambda: 0  # call once the verdicts are in the warehouse: drops saved progress


class JudgeResource(dg.ConfigurableResource):
    """Judges each task's last ok attempt. `gate` trusts the deterministic backend gate alone; `llm` asks a
    model behind an OpenAI-compatible endpoint, by majority of `votes`, reusing verdicts already paid for."""

    kind: str = Field(default="gate", description="'gate' (deterministic backend gate only) or 'llm'.")
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (env FILTER_JUDGE_BASE_URL).",
    )
    model: str | None = Field(default=None, description="Model name sent to the endpoint (env FILTER_JUDGE_MODEL).")
    api_key: str | None = Field(
        default=None, description="Bearer token, if the endpoint wants one. Set it with EnvVar: never shown in the UI."
    )
    votes: int = Field(
        default=1,
        description="Votes per task; the majority wins and a tie fails. Above 1 needs a temperature "
        "above 0; the votes are then n samples of one request where the server takes `n`.",
    )
    concurrency: int = Field(default=16, description="Most requests in flight at once.")
    timeout_seconds: float = Field(default=60.0, description="Timeout of one request.")
    temperature: float = Field(default=0.0, description="Sampling temperature (not sent to a reasoning model).")
    max_tokens: int = Field(default=800, description="Most tokens in one reply; 0: not sent (the server's default).")
    # --- the client's own settings (judge/client.py)
    task_budget_seconds: float = Field(
        default=600.0,
        description="Seconds one task may spend on retries of 408/409/429/5xx/timeouts (honouring "
        "Retry-After and the x-ratelimit-reset headers); a task still unanswered is unjudged (status error).",
    )
    reasoning_model: bool = Field(
        default=False,
        description="A reasoning model (o1-style): send max_completion_tokens instead of "
        "max_tokens, and no temperature (env FILTER_JUDGE_REASONING_MODEL).",
    )
    structured_output: bool = Field(
        default=True,
        description="Ask for a JSON-schema reply (response_format); dropped by itself where the "
        "server rejects it (env FILTER_JUDGE_STRUCTURED_OUTPUT).",
    )
    prompt_version: str = Field(
        default=PROMPT_VERSION, description="Part of the verdict cache key: change it to re-judge everything."
    )
    max_prompt_chars: int = Field(
        default=24_000,
        description="Budget of one prompt's task text in characters (the fixed system prompt aside); "
        "long actions and page text keep their head and tail, the cut marked.",
    )
    include_screenshot: bool = Field(
        default=False,
        description="Send the attempt's first and last screenshots, by natural order (multimodal models).",
    )
    min_score: int | None = Field(
        default=None,
        ge=1,
        le=5,
        description="A verdict passes only if the model passed it and its score (1-5, when it gave one) is at "
        "least this; unset: the model's verdict alone. Not part of the verdict cache key: changing it and "
        "materializing again asks nothing. Env FILTER_JUDGE_MIN_SCORE.",
    )
    # (the per-batch driver's settings: resume and cost)
    save_every_verdicts: int = Field(
        default=500,
        ge=1,
        description="Save verdicts as they arrive, every this many (warehouse/_judge_progress/<run_id>/): "
        "a killed run's next materialization asks only what was not saved. Env FILTER_JUDGE_SAVE_EVERY.",
    )
    save_every_seconds: float = Field(
        default=30.0,
        ge=0,
        description="... or every this many seconds, whichever comes first. Env FILTER_JUDGE_SAVE_SECONDS.",
    )
    price_per_million_prompt_tokens: float = Field(
        default=0.0,
        ge=0,
        description="Price of a million prompt tokens, for the cost in the metadata and the report "
        "(0 with the other prices: not priced). Env FILTER_JUDGE_PRICE_PROMPT.",
    )
    price_per_million_completion_tokens: float = Field(
        default=0.0, ge=0, description="Price of a million completion tokens. Env FILTER_JUDGE_PRICE_COMPLETION."
    )
    price_per_million_cached_tokens: float | None = Field(
        default=None,
        ge=0,
        description="Price of a million prompt tokens the endpoint served from its cache (unset: "
        "the prompt price). Env FILTER_JUDGE_PRICE_CACHED.",
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in JUDGE_KINDS:
            raise ValueError(f"judge kind {kind!r} is not one of {', '.join(JUDGE_KINDS)}")
        return kind

    def settings(self) -> llm_judge.LLMSettings:
        missing = [
            env for name, env in (("base_url", ENV["base_url"]), ("model", ENV["model"])) if not getattr(self, name)
        ]
        if missing:
            raise ValueError(f"the llm judge needs {' and '.join(missing)}")
        return llm_judge.LLMSettings(
            base_url=self.base_url, model=self.model, api_key=self.api_key, votes=self.votes,
            concurrency=self.concurrency, timeout_seconds=self.timeout_seconds, temperature=self.temperature,
            max_tokens=self.max_tokens, prompt_version=self.prompt_version,
            max_prompt_chars=self.max_prompt_chars, include_screenshot=self.include_screenshot,
            task_budget_seconds=self.task_budget_seconds, reasoning_model=self.reasoning_model,
            structured_output=self.structured_output,
        )  # fmt: skip

    def prompt_settings(self) -> PromptSettings:
        return PromptSettings(
            max_prompt_chars=self.max_prompt_chars, include_screenshot=self.include_screenshot,
            prompt_version=self.prompt_version,
        )  # fmt: skip

    def prices(self) -> driver.Prices:
        return driver.Prices(
            prompt=self.price_per_million_prompt_tokens, completion=self.price_per_million_completion_tokens,
            cached=self.price_per_million_cached_tokens,
        )  # fmt: skip

    def judge(
        self,
        requests: pd.DataFrame,
        data_root: UPath,
        record_steps: Callable[[int], list],
        previous: pd.DataFrame | None,
        log: logging.Logger,
        progress: driver.ProgressStore | None = None,
    ) -> Judgement:
        """Verdicts for `requests` (rows of rules.attempts_to_judge), same rows and order.

        `record_steps` gives an attempt record's steps by executions.jsonl line (when its trajectory.json
        cannot be used); `previous` is this partition's earlier judge_verdicts and `progress` the verdicts
        saved by a materialization that did not finish: their matching verdicts are reused. Raises
        EndpointRefused when the endpoint refuses every request.
        """
        if self.kind == "gate":
            log.info(f"judged {len(requests)}/{len(requests)} tasks with the deterministic gate")
            return Judgement(gate_verdicts(requests), {"judge": "gate"})
        return _llm_judgement(requests, self, data_root, record_steps, previous, progress, log)


def _flag(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
        raise ValueError(text)
    return text.lower() in ("1", "true", "yes")


_flag.__name__ = "flag (true/false)"
_ENV_TYPES = {"votes": int, "concurrency": int, "timeout_seconds": float, "temperature": float,
              "max_tokens": int, "include_screenshot": _flag, "min_score": int,
              "task_budget_seconds": float, "reasoning_model": _flag, "structured_output": _flag,
              "save_every_verdicts": int, "save_every_seconds": float, "price_per_million_prompt_tokens": float,
              "price_per_million_completion_tokens": float, "price_per_million_cached_tokens": float}  # fmt: skip


def judge_from_env(kind: str | None = None, overrides: dict | None = None) -> JudgeResource:
    """The judge resource configured by FILTER_JUDGE_* variables, `overrides` in their place; the API key is
    wired as an EnvVar so Dagster shows its name, never its value."""
    values: dict = {"kind": kind or os.environ.get(ENV["kind"], "gate")}
    for name, env in ENV.items():
        if name in ("kind", "api_key") or env not in os.environ:
            continue
        parse = _ENV_TYPES.get(name, str)
        try:
            values[name] = parse(os.environ[env])
        except ValueError:
            raise ValueError(f"{env}={os.environ[env]!r} is not a valid {parse.__name__}") from None
    if os.environ.get(ENV["api_key"]):
        values["api_key"] = dg.EnvVar(ENV["api_key"])
    return JudgeResource(**{**values, **(overrides or {})})


# --- the LLM path -----------------------------------------------------------------------------------


def _llm_judgement(
    requests: pd.DataFrame,
    resource: "JudgeResource",
    data_root: UPath,
    record_steps: Callable[[int], list],
    previous: pd.DataFrame | None,
    progress: driver.ProgressStore | None,
    log: logging.Logger,
) -> Judgement:
    settings, prompt_settings, prices = resource.settings(), resource.prompt_settings(), resource.prices()
    saved = progress.load(log) if progress is not None else None
    reusable, resumable = driver.reusable_verdicts(previous, saved)
    log.info(
        f"llm judge: {len(requests)} tasks; {len(reusable)} verdicts on file for this run, {resumable} of them "
        f"saved by an earlier materialization that did not finish"
    )
    result = driver.drive(
        requests,
        client_factory=lambda: llm_judge.JudgeClient(settings),
        concurrency=settings.concurrency,
        data_root=data_root,
        record_steps=record_steps,
        prompt_settings=prompt_settings,
        judge_identity=judge_identity(settings),
        reusable=reusable,
        progress=progress,
        save_every=resource.save_every_verdicts,
        save_every_seconds=resource.save_every_seconds,
        redact=lambda text: _redact(text, settings),
        log=log,
    )
    frame, below_min_score = driver.apply_min_score(result.frame, resource.min_score)
    cost = prices.cost(_ints(frame["prompt_tokens"]), _ints(frame["completion_tokens"]), _ints(frame["cached_tokens"]))
    verdicts = requests.reset_index(drop=True).assign(
        **frame, cost=cost, judge="llm", model=settings.model, prompt_version=prompt_settings.prompt_version
    )
    _warn_missing_evidence(verdicts, log)
    metadata = _llm_metadata(verdicts, result.stats, settings, prompt_settings, prices)
    metadata.update(min_score=resource.min_score or "not set", below_min_score=below_min_score)
    return Judgement(verdicts, metadata, written=progress.remove if progress is not None else lambda: 0)


def judge_identity(settings) -> list:
    """What of the judge's settings decides a verdict, for the cache key (with the prompt version and messages)."""
    return [getattr(settings, name, None) for name in ("model", "votes", "temperature")]


def _ints(values: pd.Series) -> np.ndarray:
    return pd.to_numeric(values, errors="coerce").fillna(0).to_numpy(dtype=float)


def _redact(text: str | None, settings) -> str | None:
    if text is None or not settings.api_key:
        return text
    return text.replace(settings.api_key, "***")


def _warn_missing_evidence(verdicts: pd.DataFrame, log: logging.Logger, shown: int = 5) -> None:
    missing = verdicts[verdicts["evidence"].notna() & (verdicts["evidence"] != EVIDENCE_TRAJECTORY)]
    if missing.empty:
        return
    examples = ", ".join(
        f"{d} ({e.split(': ', 1)[-1]})" for d, e in zip(missing["dir"].head(shown), missing["evidence"].head(shown))
    )
    log.warning(
        f"llm judge: {len(missing)} of {len(verdicts)} attempts judged without their full trajectory.json "
        f"(from the attempt record's steps, no page text), e.g. {examples}; see the evidence column"
    )


def evidence_counts(verdicts: pd.DataFrame) -> dict[str, int]:
    """Verdicts per kind of evidence (schemas.evidence_kind), most common first."""
    if "evidence" not in verdicts:
        return {}
    kinds = verdicts["evidence"].dropna().map(evidence_kind).value_counts()
    return {str(k): int(n) for k, n in kinds.items()}


def _llm_metadata(verdicts: pd.DataFrame, stats: driver.DriveStats, settings, prompt_settings, prices) -> dict:
    judged = verdicts[verdicts["status"] == STATUS_JUDGED]
    asked = verdicts[~verdicts["cached"].astype(bool)]  # what this materialization paid for (copies carry 0)
    spent = {
        name: int(_ints(asked[name]).sum())
        for name in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
    }
    latencies = np.frombuffer(stats.latencies_ms, dtype=np.float64) if len(stats.latencies_ms) else np.zeros(0)
    evidence = evidence_counts(verdicts)
    missing = sum(n for kind, n in evidence.items() if kind != EVIDENCE_TRAJECTORY)
    metadata = {
        "judge": "llm",
        "model": settings.model,
        "prompt_version": prompt_settings.prompt_version,
        **spent,
        "cost": float(np.nansum(asked["cost"].to_numpy(dtype=float)))
        if prices.priced
        else "not priced (FILTER_JUDGE_PRICE_*)",
        "asked": stats.asked,
        "cache_hits": stats.reused,
        "resumed_from_progress": stats.resumed,
        "deduplicated": stats.deduplicated,
        "progress_parts_saved": stats.parts_saved,
        "latency_p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else 0.0,
        "latency_p95_ms": float(np.percentile(latencies, 95)) if len(latencies) else 0.0,
        "unjudged": int((verdicts["status"] == STATUS_ERROR).sum()),
        "pass_rate": float((judged["passed"] == True).mean()) if len(judged) else 0.0,  # noqa: E712
        "evidence_missing": missing,
        "agreement_with_gate": dg.MetadataValue.md(agreement_markdown(verdicts)),
    }
    if missing:
        table = "| evidence | verdicts |\n|---|---|\n" + "\n".join(f"| {k} | {n} |" for k, n in evidence.items())
        metadata["evidence"] = dg.MetadataValue.md(table)
    return metadata
