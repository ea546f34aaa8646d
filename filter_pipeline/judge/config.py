"""The LLM judge's settings, written once: each field's default, description and environment variable.

`LLMJudgeConfig` is the `llm` part of `JudgeResource` (what the Dagster UI shows), what `judge_from_env`
fills from FILTER_JUDGE_* in one loop over its fields, and what the client, the prompt builder and the
per-batch driver take as it is.
"""

import os

import dagster as dg
from pydantic import Field

from filter_pipeline.judge.prompt import PROMPT_VERSION
from filter_pipeline.settings import JUDGE_KIND_ENV


def _env(name: str) -> dict:
    return {"env": name}


class LLMJudgeConfig(dg.Config):
    """How the LLM judge is asked (CONTRACT §8 settings, plus this project's own after `votes`)."""

    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.",
        json_schema_extra=_env("FILTER_JUDGE_BASE_URL"),
    )
    model: str | None = Field(
        default=None, description="Model name sent to the endpoint.", json_schema_extra=_env("FILTER_JUDGE_MODEL")
    )
    api_key: str | None = Field(
        default=None,
        description="Bearer token, if the endpoint wants one. Set it with EnvVar: never shown in the UI.",
        json_schema_extra=_env("FILTER_JUDGE_API_KEY"),
    )
    votes: int = Field(
        default=1,
        description="Votes per task; the majority wins and a tie fails. Above 1 needs a temperature "
        "above 0; the votes are then n samples of one request where the server takes `n`.",
        json_schema_extra=_env("FILTER_JUDGE_VOTES"),
    )
    concurrency: int = Field(
        default=16, description="Most requests in flight at once.", json_schema_extra=_env("FILTER_JUDGE_CONCURRENCY")
    )
    timeout_seconds: float = Field(
        default=60.0, description="Timeout of one request.", json_schema_extra=_env("FILTER_JUDGE_TIMEOUT")
    )
    temperature: float = Field(
        default=0.0,
        description="Sampling temperature (not sent to a reasoning model).",
        json_schema_extra=_env("FILTER_JUDGE_TEMPERATURE"),
    )
    max_tokens: int = Field(
        default=800,
        description="Most tokens in one reply (the answer reasons before its verdict); 0: not sent (the "
        "server's default).",
        json_schema_extra=_env("FILTER_JUDGE_MAX_TOKENS"),
    )
    task_budget_seconds: float = Field(
        default=600.0,
        description="Seconds one task may spend on retries of 408/409/429/5xx/timeouts (honouring "
        "Retry-After and the x-ratelimit-reset headers); a task still unanswered is unjudged (status error).",
        json_schema_extra=_env("FILTER_JUDGE_TASK_BUDGET"),
    )
    reasoning_model: bool = Field(
        default=False,
        description="A reasoning model (o1-style): send max_completion_tokens instead of max_tokens, and no "
        "temperature.",
        json_schema_extra=_env("FILTER_JUDGE_REASONING_MODEL"),
    )
    structured_output: bool = Field(
        default=True,
        description="Ask for a JSON-schema reply (response_format); dropped by itself where the server rejects it.",
        json_schema_extra=_env("FILTER_JUDGE_STRUCTURED_OUTPUT"),
    )
    prompt_version: str = Field(
        default=PROMPT_VERSION,
        description="Part of the verdict cache key: change it to re-judge everything.",
        json_schema_extra=_env("FILTER_JUDGE_PROMPT_VERSION"),
    )
    min_score: int | None = Field(
        default=None,
        ge=1,
        le=5,
        description="A verdict passes only if the model passed it and its score (1-5, when it gave one) is at "
        "least this; unset: the model's verdict alone. Not part of the verdict cache key: changing it and "
        "materializing again asks nothing.",
        json_schema_extra=_env("FILTER_JUDGE_MIN_SCORE"),
    )
    include_screenshot: bool = Field(
        default=False,
        description="Send the attempt's first and last screenshots, by natural order (multimodal models).",
        json_schema_extra=_env("FILTER_JUDGE_SCREENSHOT"),
    )
    max_prompt_chars: int = Field(
        default=24_000,
        description="Budget of one prompt's task text in characters (the fixed system prompt aside); "
        "long actions and page text keep their head and tail, the cut marked.",
    )
    save_every_verdicts: int = Field(
        default=500,
        ge=1,
        description="Save verdicts as they arrive, every this many (warehouse/_judge_progress/<run_id>/): "
        "a killed run's next materialization asks only what was not saved.",
        json_schema_extra=_env("FILTER_JUDGE_SAVE_EVERY"),
    )
    save_every_seconds: float = Field(
        default=30.0,
        ge=0,
        description="... or every this many seconds, whichever comes first.",
        json_schema_extra=_env("FILTER_JUDGE_SAVE_SECONDS"),
    )
    price_per_million_prompt_tokens: float = Field(
        default=0.0,
        ge=0,
        description="Price of a million prompt tokens, for the cost in the metadata and the report "
        "(0 with the other prices: not priced).",
        json_schema_extra=_env("FILTER_JUDGE_PRICE_PROMPT"),
    )
    price_per_million_completion_tokens: float = Field(
        default=0.0,
        ge=0,
        description="Price of a million completion tokens.",
        json_schema_extra=_env("FILTER_JUDGE_PRICE_COMPLETION"),
    )
    price_per_million_cached_tokens: float | None = Field(
        default=None,
        ge=0,
        description="Price of a million prompt tokens the endpoint served from its cache (unset: the prompt price).",
        json_schema_extra=_env("FILTER_JUDGE_PRICE_CACHED"),
    )
    backoff_initial_seconds: float = Field(
        default=0.5, gt=0, description="First wait before retrying a transient fault (doubled per retry)."
    )
    backoff_max_seconds: float = Field(default=8.0, gt=0, description="Longest wait between two retries.")

    def check(self) -> None:
        """Refuse, in one line, what the client cannot work with, before any request."""
        missing = [env_name(name) for name in ("base_url", "model") if not getattr(self, name)]
        if missing:
            raise ValueError(f"the llm judge needs {' and '.join(missing)}")
        if self.votes < 1:
            raise ValueError(f"judge votes={self.votes}: at least 1")
        if self.votes > 1 and self.temperature <= 0 and not self.reasoning_model:
            raise ValueError(
                f"judge votes={self.votes} at temperature={self.temperature}: identical samples at temperature 0 "
                "cannot disagree; set votes=1, or a temperature above 0 (e.g. 0.7) for a majority of samples"
            )
        if self.concurrency < 1:
            raise ValueError(f"judge concurrency={self.concurrency}: at least 1")
        if self.max_tokens < 0:
            raise ValueError(f"judge max_tokens={self.max_tokens}: 0 (not sent) or more")
        if not self.task_budget_seconds > 0 or not self.timeout_seconds > 0:
            raise ValueError("judge task_budget_seconds and timeout_seconds must be above 0")

    def identity(self) -> list:
        """What of the settings decides a verdict, for the cache key (with the prompt version and messages)."""
        return [self.model, self.votes, self.temperature]

    def redact(self, text: str | None) -> str | None:
        """`text` with the API key replaced by ***: nothing the judge writes or raises carries it."""
        key = self.api_key
        return text.replace(key, "***") if key and isinstance(key, str) and text else text


def env_name(field: str) -> str | None:
    """The environment variable of a setting (None: set in Dagster's config only)."""
    extra = LLMJudgeConfig.model_fields[field].json_schema_extra
    return extra.get("env") if isinstance(extra, dict) else None


# every environment variable of the judge by setting: `kind` and the LLM settings
ENV: dict[str, str] = {
    "kind": JUDGE_KIND_ENV,
    **{name: env for name in LLMJudgeConfig.model_fields if (env := env_name(name)) is not None},
}


def _flag(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
        raise ValueError(text)
    return text.lower() in ("1", "true", "yes")


# how a variable's text becomes a setting, by the setting's type, and the name an error gives that type
_PARSERS = {bool: (_flag, "flag (true/false)"), int: (int, "int"), float: (float, "float")}


def config_from_env(overrides: dict | None = None) -> LLMJudgeConfig:
    """The LLM settings that FILTER_JUDGE_* variables give, `overrides` in their place; the API key is wired
    as an EnvVar so Dagster shows its name, never its value."""
    values: dict = {}
    for name, field in LLMJudgeConfig.model_fields.items():
        env = env_name(name)
        if env is None or env not in os.environ:
            continue
        if name == "api_key":
            if os.environ[env]:
                values[name] = dg.EnvVar(env)
            continue
        kind = next((t for t in _PARSERS if t in (field.annotation, *getattr(field.annotation, "__args__", ()))), str)
        parse, type_name = _PARSERS.get(kind, (str, "text"))
        try:
            values[name] = parse(os.environ[env])
        except ValueError:
            raise ValueError(f"{env}={os.environ[env]!r} is not a valid {type_name}") from None
    return LLMJudgeConfig(**{**values, **(overrides or {})})
