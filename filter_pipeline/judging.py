"""The judge: turns the attempts to judge into verdicts.

`JudgeResource` is what assets see; `kind` picks the implementation, so a new judge plugs in here without
touching an asset. Every implementation returns one verdict row per request, in request order, with
`passed`, `why`, `votes` and `status` (`judged`, or `error` for a task that could not be judged).
"""

import logging

import dagster as dg
import pandas as pd
from pydantic import Field, field_validator
from upath import UPath

from filter_pipeline.schemas import GATE_VOTES, GATE_WHY, STATUS_JUDGED

JUDGE_KINDS = ("gate",)


def gate_verdicts(requests: pd.DataFrame) -> pd.DataFrame:
    """The deterministic gate alone: every attempt it is shown already passed the backend gate (`ok`)."""
    return requests.assign(passed=True, why=GATE_WHY, votes=GATE_VOTES, status=STATUS_JUDGED)


class JudgeResource(dg.ConfigurableResource):
    """Judges each task's last ok attempt. `gate` trusts the deterministic backend gate alone."""

    kind: str = Field(default="gate", description="Which judge decides: 'gate' (the deterministic backend gate only).")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in JUDGE_KINDS:
            raise ValueError(f"judge kind {kind!r} is not one of {', '.join(JUDGE_KINDS)}")
        return kind

    def judge(self, requests: pd.DataFrame, data_root: UPath, log: logging.Logger) -> pd.DataFrame:
        """Verdicts for `requests` (rows of rules.attempts_to_judge), same rows and order, plus verdict columns."""
        verdicts = gate_verdicts(requests)
        log.info(f"judged {len(verdicts)}/{len(requests)} tasks with the deterministic gate")
        return verdicts
