"""The judge: turns the attempts to judge into verdicts.

`JudgeResource` is what assets see; `kind` picks the implementation, so a new judge plugs in here without
touching an asset. Every implementation returns one verdict row per request, in request order, with
`passed`, `why`, `votes` and `status` (`judged`, or `error` for a task that could not be judged).
"""

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import dagster as dg
import numpy as np
import pandas as pd
from pydantic import Field, field_validator
from upath import UPath

from filter_pipeline.judge import llm as llm_judge
from filter_pipeline.rules.report import agreement_markdown
from filter_pipeline.rules.schemas import GATE_VOTES, GATE_WHY, STATUS_ERROR, STATUS_JUDGED
from filter_pipeline.settings import JUDGE_KIND_ENV, JUDGE_KINDS

# CONTRACT §5 environment settings of the LLM judge (plus the ones after VOTES, this project's own).
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
    "include_screenshot": "FILTER_JUDGE_SCREENSHOT",
}


def gate_verdicts(requests: pd.DataFrame) -> pd.DataFrame:
    """The deterministic gate alone: every attempt it is shown already passed the backend gate (`ok`)."""
    return requests.assign(
        passed=True, why=GATE_WHY, votes=GATE_VOTES, status=STATUS_JUDGED, judge="gate", cached=False, calls=0
    )


@dataclass(frozen=True)
class Judgement:
    verdicts: pd.DataFrame  # the requests plus verdict columns, same rows and order
    metadata: dict  # figures for the judge_verdicts materialization


class JudgeResource(dg.ConfigurableResource):
    """Judges each task's last ok attempt. `gate` trusts the deterministic backend gate alone; `llm` asks a
    model behind an OpenAI-compatible endpoint, by majority of `votes`, reusing verdicts already paid for."""

    kind: str = Field(default="gate", description="'gate' (deterministic backend gate only) or 'llm'.")
    base_url: Optional[str] = Field(
        default=None, description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (env FILTER_JUDGE_BASE_URL)."
    )
    model: Optional[str] = Field(default=None, description="Model name sent to the endpoint (env FILTER_JUDGE_MODEL).")
    api_key: Optional[str] = Field(
        default=None, description="Bearer token, if the endpoint wants one. Set it with EnvVar: never shown in the UI."
    )
    votes: int = Field(
        default=1, description="Votes per task; the majority wins and a tie fails. Above 1 needs a temperature "
        "above 0; the votes are then n samples of one request where the server takes `n`."
    )
    concurrency: int = Field(default=16, description="Most requests in flight at once.")
    timeout_seconds: float = Field(default=60.0, description="Timeout of one request.")
    temperature: float = Field(default=0.0, description="Sampling temperature (not sent to a reasoning model).")
    max_tokens: int = Field(default=300, description="Most tokens in one reply; 0: not sent (the server's default).")
    # --- the client's own settings (judge/client.py)
    task_budget_seconds: float = Field(
        default=600.0, description="Seconds one task may spend on retries of 408/409/429/5xx/timeouts (honouring "
        "Retry-After and the x-ratelimit-reset headers); a task still unanswered is unjudged (status error)."
    )
    reasoning_model: bool = Field(
        default=False, description="A reasoning model (o1-style): send max_completion_tokens instead of "
        "max_tokens, and no temperature (env FILTER_JUDGE_REASONING_MODEL)."
    )
    structured_output: bool = Field(
        default=True, description="Ask for a JSON-schema reply (response_format); dropped by itself where the "
        "server rejects it (env FILTER_JUDGE_STRUCTURED_OUTPUT)."
    )
    prompt_version: str = Field(
        default=llm_judge.PROMPT_VERSION, description="Part of the verdict cache key: change it to re-judge everything."
    )
    max_prompt_chars: int = Field(default=24_000, description="Budget of one prompt; long page text is cut, and marked.")
    include_screenshot: bool = Field(default=False, description="Send the attempt's last screenshot (multimodal models).")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in JUDGE_KINDS:
            raise ValueError(f"judge kind {kind!r} is not one of {', '.join(JUDGE_KINDS)}")
        return kind

    def settings(self) -> llm_judge.LLMSettings:
        missing = [env for name, env in (("base_url", ENV["base_url"]), ("model", ENV["model"])) if not getattr(self, name)]
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

    def judge(
        self,
        requests: pd.DataFrame,
        data_root: UPath,
        steps_for: Callable[[set[int]], dict[int, list]],
        previous: pd.DataFrame | None,
        log: logging.Logger,
    ) -> Judgement:
        """Verdicts for `requests` (rows of rules.attempts_to_judge), same rows and order.

        `steps_for` gives attempt records' steps by executions.jsonl line (when a trajectory.json is
        missing); `previous` is this partition's earlier judge_verdicts, whose matching verdicts are reused.
        """
        if self.kind == "gate":
            log.info(f"judged {len(requests)}/{len(requests)} tasks with the deterministic gate")
            return Judgement(gate_verdicts(requests), {"judge": "gate"})
        return _llm_judgement(requests, self.settings(), data_root, steps_for, previous, log)


def _flag(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
        raise ValueError(text)
    return text.lower() in ("1", "true", "yes")


_flag.__name__ = "flag (true/false)"
_ENV_TYPES = {"votes": int, "concurrency": int, "timeout_seconds": float, "temperature": float,
              "max_tokens": int, "include_screenshot": _flag,
              "task_budget_seconds": float, "reasoning_model": _flag, "structured_output": _flag}  # fmt: skip


def judge_from_env(kind: str | None = None) -> JudgeResource:
    """The judge resource configured by FILTER_JUDGE_* variables; the API key is wired as an EnvVar so
    Dagster shows its name, never its value."""
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
    return JudgeResource(**values)


# --- the LLM path -----------------------------------------------------------------------------------


def _llm_judgement(
    requests: pd.DataFrame,
    settings: llm_judge.LLMSettings,
    data_root: UPath,
    steps_for: Callable[[set[int]], dict[int, list]],
    previous: pd.DataFrame | None,
    log: logging.Logger,
) -> Judgement:
    fallback_cache: dict[int, list] = {}

    def fallback(line: int) -> list:
        if line not in fallback_cache:
            fallback_cache.update(steps_for({line}))
        return fallback_cache.get(line, [])

    messages = [
        llm_judge.messages_for_attempt(data_root, instr, rel_dir, lambda line=int(line): fallback(line), settings)
        for instr, rel_dir, line in zip(requests["instruction"], requests["dir"], requests["attempt_line"])
    ]
    keys = [llm_judge.cache_key(m, settings) for m in messages]
    reusable = _reusable(previous)
    to_ask = [i for i, k in enumerate(keys) if k not in reusable]
    log.info(f"llm judge: {len(requests)} tasks, {len(requests) - len(to_ask)} verdicts reused, asking {len(to_ask)}")

    step = max(1, len(to_ask) // 10)

    def progress(done: int) -> None:
        if done % step == 0 or done == len(to_ask):
            log.info(f"judged {done}/{len(to_ask)} tasks")

    fresh = dict(zip(to_ask, llm_judge.judge_prompts([messages[i] for i in to_ask], settings, progress)))
    rows = []
    for i, key in enumerate(keys):
        if i in fresh:
            v = fresh[i]
            rows.append(
                dict(passed=v.passed, why=_redact(v.why, settings), votes=v.votes, status=v.status, cached=False,
                     calls=v.calls, prompt_tokens=v.prompt_tokens, completion_tokens=v.completion_tokens,
                     latency_ms=v.latency_ms, raw_replies=_redact(v.raw_replies, settings),
                     replies_sha256=v.replies_sha256)
            )  # fmt: skip
        else:
            rows.append({**reusable[key], "cached": True})
    verdicts = requests.reset_index(drop=True).assign(
        **pd.DataFrame(rows, index=range(len(keys))), judge="llm", model=settings.model,
        prompt_version=settings.prompt_version, cache_key=keys,
    )  # fmt: skip
    latencies = [ms for v in fresh.values() for ms in v.call_latencies_ms]
    return Judgement(verdicts, _llm_metadata(verdicts, fresh, latencies, settings))


_REUSED = ["passed", "why", "votes", "status", "calls", "prompt_tokens", "completion_tokens", "latency_ms",
           "raw_replies", "replies_sha256"]  # fmt: skip


def _reusable(previous: pd.DataFrame | None) -> dict[str, dict]:
    """cache_key -> verdict fields of the previous materialization's judged LLM verdicts (errors are re-asked)."""
    if previous is None or previous.empty or "cache_key" not in previous:
        return {}
    judged = previous[(previous["status"] == STATUS_JUDGED) & previous["cache_key"].notna()]
    return {row["cache_key"]: {c: row[c] for c in _REUSED} for row in judged.to_dict("records")}


def _redact(text: str | None, settings: llm_judge.LLMSettings) -> str | None:
    if text is None or not settings.api_key:
        return text
    return text.replace(settings.api_key, "***")


def _llm_metadata(verdicts: pd.DataFrame, fresh: dict, latencies: list[float], settings) -> dict:
    judged = verdicts[verdicts["status"] == STATUS_JUDGED]
    new = list(fresh.values())
    return {
        "judge": "llm",
        "model": settings.model,
        "prompt_version": settings.prompt_version,
        "calls": sum(v.calls for v in new),
        "cache_hits": int(verdicts["cached"].sum()),
        "prompt_tokens": sum(v.prompt_tokens for v in new),
        "completion_tokens": sum(v.completion_tokens for v in new),
        "latency_p50_ms": float(np.percentile(latencies, 50)) if latencies else 0.0,
        "latency_p95_ms": float(np.percentile(latencies, 95)) if latencies else 0.0,
        "unjudged": int((verdicts["status"] == STATUS_ERROR).sum()),
        "pass_rate": float((judged["passed"] == True).mean()) if len(judged) else 0.0,  # noqa: E712
        "agreement_with_gate": dg.MetadataValue.md(agreement_markdown(verdicts)),
    }
