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

from filter_pipeline.judge import driver
from filter_pipeline.judge.client import JudgeClient
from filter_pipeline.judge.config import ENV, LLMJudgeConfig, config_from_env
from filter_pipeline.rules.descriptions import markdown_table
from filter_pipeline.rules.filtering import unjudged_count
from filter_pipeline.rules.report import agreement_markdown
from filter_pipeline.rules.schemas import (
    EVIDENCE_TRAJECTORY,
    JUDGE_PROGRESS_PARTS,
    SPEND_COUNTS,
    evidence_kind,
    evidence_problem,
)
from filter_pipeline.rules.vocabulary import GATE_VOTES, GATE_WHY, STATUS_JUDGED
from filter_pipeline.settings import DEFAULT_JUDGE, JUDGE_GATE, JUDGE_KINDS, JUDGE_LLM

__all__ = ["ENV", "JudgeResource", "judge_from_env"]


def gate_verdicts(requests: pd.DataFrame) -> pd.DataFrame:
    """The deterministic gate alone: every attempt it is shown already passed the backend gate (`ok`)."""
    return requests.assign(
        passed=True,
        why=GATE_WHY,
        votes=GATE_VOTES,
        status=STATUS_JUDGED,
        judge=JUDGE_GATE,
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

    kind: str = Field(
        default=DEFAULT_JUDGE, description=f"'{JUDGE_GATE}' (deterministic backend gate only) or '{JUDGE_LLM}'."
    )
    llm: LLMJudgeConfig = Field(
        default_factory=LLMJudgeConfig, description="The LLM judge's settings (used when kind is 'llm')."
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in JUDGE_KINDS:
            raise ValueError(f"judge kind {kind!r} is not one of {', '.join(JUDGE_KINDS)}")
        return kind

    def identity(self) -> dict:
        """This judge as a commit record names it (`commits.JUDGE_IDENTITY`, `commits.judge_settings`): kind, and
        the LLM's model, prompt version, votes per task and a digest of every setting its cache key depends on."""
        if self.kind == JUDGE_GATE:
            return {"kind": JUDGE_GATE, "model": None, "prompt_version": None, "votes": GATE_VOTES, "settings": None}
        return {"kind": self.kind, "model": self.llm.model, "prompt_version": self.llm.prompt_version,
                "votes": str(self.llm.votes), "settings": self.llm.settings_digest()}  # fmt: skip

    def settings(self) -> LLMJudgeConfig:
        """The LLM settings, checked: a missing endpoint or model, or settings that cannot work, in one line."""
        self.llm.check()
        return self.llm

    def prices(self) -> driver.Prices:
        c = self.llm
        return driver.Prices(
            prompt=c.price_per_million_prompt_tokens, completion=c.price_per_million_completion_tokens,
            cached=c.price_per_million_cached_tokens,
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
        """Verdicts for `requests` (rows of rules.filtering.attempts_to_judge), same rows and order.

        `record_steps` gives an attempt record's steps by executions.jsonl line (when its trajectory.json
        cannot be used); `previous` is this partition's earlier judge_verdicts and `progress` the verdicts
        saved by a materialization that did not finish: their matching verdicts are reused. Raises
        EndpointRefused at the endpoint's first refusal, JudgeSetupError for a setting the client cannot use.
        """
        if self.kind == JUDGE_GATE:
            log.info(f"judged {len(requests)}/{len(requests)} tasks with the deterministic gate")
            return Judgement(gate_verdicts(requests), {"judge": JUDGE_GATE})
        return _llm_judgement(requests, self, data_root, record_steps, previous, progress, log)


def judge_from_env(kind: str | None = None, overrides: dict | None = None, env_vars: bool = True) -> JudgeResource:
    """The judge resource configured by FILTER_JUDGE_* variables, `overrides` (LLM settings) in their place.
    `env_vars`: the settings that may hold a secret as EnvVar, for Dagster (`config_from_env`); False, as their
    values, for a process that asks the endpoint itself."""
    kind = kind or os.environ.get(ENV["kind"], DEFAULT_JUDGE)
    return JudgeResource(kind=kind, llm=config_from_env(overrides, env_vars))


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
    config, prices = resource.settings(), resource.prices()
    counted = previous.attrs.get(JUDGE_PROGRESS_PARTS, ()) if previous is not None else ()
    saved = progress.load(log, counted) if progress is not None else None
    reusable, resumable = driver.reusable_verdicts(previous, saved)
    log.info(
        f"llm judge: {len(requests)} tasks; {len(reusable)} verdicts on file for this run, {resumable} of them "
        f"saved by an earlier materialization that did not finish"
    )
    job = driver.DriveJob(
        requests=requests, config=config, data_root=data_root, record_steps=record_steps, reusable=reusable,
        client_factory=lambda: JudgeClient(config, report=log.warning), progress=progress, log=log,
    )  # fmt: skip
    result = driver.drive(job)
    frame = result.frame.assign(passed=driver.passes(result.frame, config.min_score))
    verdicts = requests.reset_index(drop=True).assign(
        **frame, cost=_cost(frame, prices), judge=JUDGE_LLM, model=config.model, prompt_version=config.prompt_version
    )
    _warn_missing_evidence(verdicts, log)
    metadata = _llm_metadata(verdicts, result.stats, config, prices)  # (what this materialization paid)
    below = (verdicts["judge_passed"] == True) & (verdicts["passed"] == False)  # noqa: E712
    metadata.update(min_score=config.min_score or "not set", below_min_score=int(below.sum()))
    earlier = driver.earlier_spend(previous, requests, frame["cache_key"], saved)
    verdicts = _with_earlier_spend(verdicts, earlier, prices)
    if progress is not None:
        verdicts.attrs[JUDGE_PROGRESS_PARTS] = progress.part_names()
    return Judgement(verdicts, metadata, written=progress.remove if progress is not None else lambda: 0)


def _cost(frame: pd.DataFrame, prices: driver.Prices):
    return prices.cost(_ints(frame["prompt_tokens"]), _ints(frame["completion_tokens"]), _ints(frame["cached_tokens"]))


def _with_earlier_spend(verdicts: pd.DataFrame, earlier: pd.DataFrame, prices: driver.Prices) -> pd.DataFrame:
    """`verdicts` whose rows replace unjudged ones carrying the requests and tokens those tries spent (and
    their cost): each row says what its task's judging cost, every try included."""
    again = earlier.to_numpy().any(axis=1)
    if not again.any():
        return verdicts
    verdicts = verdicts.copy()
    for name in SPEND_COUNTS:
        values = verdicts[name].astype(object).to_numpy(copy=True)
        values[again] = (_ints(verdicts[name])[again] + earlier[name].to_numpy()[again]).astype(np.int64)
        verdicts[name] = values
    verdicts["cost"] = _cost(verdicts, prices)
    return verdicts


def _ints(values: pd.Series) -> np.ndarray:
    return pd.to_numeric(values, errors="coerce").fillna(0).to_numpy(dtype=float)


def _warn_missing_evidence(verdicts: pd.DataFrame, log: logging.Logger, shown: int = 5) -> None:
    missing = verdicts[verdicts["evidence"].notna() & (verdicts["evidence"] != EVIDENCE_TRAJECTORY)]
    if missing.empty:
        return
    examples = ", ".join(
        f"{d} ({evidence_problem(e)})" for d, e in zip(missing["dir"].head(shown), missing["evidence"].head(shown))
    )
    log.warning(
        f"llm judge: {len(missing)} of {len(verdicts)} attempts judged without their whole trajectory.json "
        f"(their actions from the attempt record's steps), e.g. {examples}; see the evidence column"
    )


def evidence_counts(verdicts: pd.DataFrame) -> dict[str, int]:
    """Verdicts per kind of evidence (schemas.evidence_kind), most common first."""
    if "evidence" not in verdicts:
        return {}
    kinds = verdicts["evidence"].dropna().map(evidence_kind).value_counts()
    return {str(k): int(n) for k, n in kinds.items()}


def _llm_metadata(verdicts: pd.DataFrame, stats: driver.DriveStats, config: LLMJudgeConfig, prices) -> dict:
    judged = verdicts[verdicts["status"] == STATUS_JUDGED]
    asked = verdicts[~verdicts["cached"].astype(bool)]  # what this materialization paid for (copies carry 0)
    spent = {name: int(_ints(asked[name]).sum()) for name in SPEND_COUNTS}
    latencies = np.frombuffer(stats.latencies_ms, dtype=np.float64) if len(stats.latencies_ms) else np.zeros(0)
    evidence = evidence_counts(verdicts)
    missing = sum(n for kind, n in evidence.items() if kind != EVIDENCE_TRAJECTORY)
    metadata = {
        "judge": JUDGE_LLM,
        "model": config.model,
        "prompt_version": config.prompt_version,
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
        "unjudged": unjudged_count(verdicts),
        "pass_rate": float((judged["passed"] == True).mean()) if len(judged) else 0.0,  # noqa: E712
        "evidence_missing": missing,
        "agreement_with_gate": dg.MetadataValue.md(agreement_markdown(verdicts)),
    }
    if missing:
        table = pd.DataFrame({"evidence": list(evidence), "verdicts": list(evidence.values())})
        metadata["evidence"] = dg.MetadataValue.md(markdown_table(table))
    return metadata
