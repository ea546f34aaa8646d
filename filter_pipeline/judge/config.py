"""The LLM judge's settings, written once: each field's default, description and environment variable.

`LLMJudgeConfig` is the `llm` part of `JudgeResource` (what the Dagster UI shows), what `judge_from_env`
fills from FILTER_JUDGE_* in one loop over its fields, and what the client, the prompt builder and the
per-batch driver take as it is.
"""

import base64
import functools
import hashlib
import json
import math
import os
import re
from urllib.parse import unquote, unquote_plus, urlsplit

import dagster as dg
from pydantic import Field

from filter_pipeline.judge.prompt import PROMPT_VERSION, PROMPTS
from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.rules.schemas import JUDGE_PROGRESS_FOLDER, SCORE_RANGE
from filter_pipeline.settings import JUDGE_KIND_ENV


def _setting(default, description: str, env: str | None = None, **constraints):
    """A field whose description names its environment variable, kept beside it for `config_from_env`."""
    if env is None:
        return Field(default=default, description=description, **constraints)
    return Field(
        default=default, description=f"{description} Env {env}.", json_schema_extra={"env": env}, **constraints
    )


class LLMJudgeConfig(dg.Config):
    """How the LLM judge is asked (CONTRACT §8): each setting with its FILTER_JUDGE_* variable, but for the prompt's
    length limit and the back-off, which have none."""

    base_url: str | None = _setting(
        None,
        "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1. Set it with EnvVar (as the environment sets "
        "it) when it holds a key, in its path, query or user part: the resource's config then shows the "
        "variable's name. The judge's lines name the endpoint without its query, user part or API key.",
        env="FILTER_JUDGE_BASE_URL",
    )
    model: str | None = _setting(None, "Model name sent to the endpoint.", env="FILTER_JUDGE_MODEL")
    api_key: str | None = _setting(
        None,
        "Bearer token, if the endpoint wants one. Set it with EnvVar: never shown in the UI.",
        env="FILTER_JUDGE_API_KEY",
    )
    votes: int = _setting(
        1,
        "Votes per task; the majority wins and a tie fails. Above 1 needs a temperature above 0 (or a "
        "reasoning model, sent no temperature); the votes are then n samples of one request where the server "
        "takes `n`.",
        env="FILTER_JUDGE_VOTES",
    )
    concurrency: int = _setting(16, "Most requests in flight at once.", env="FILTER_JUDGE_CONCURRENCY")
    timeout_seconds: float = _setting(60.0, "Timeout of one request.", env="FILTER_JUDGE_TIMEOUT")
    temperature: float = _setting(
        0.0, "Sampling temperature (not sent to a reasoning model).", env="FILTER_JUDGE_TEMPERATURE"
    )
    max_tokens: int = _setting(
        800,
        "Most tokens in one reply (the answer reasons before its verdict); 0: not sent (the server's default).",
        env="FILTER_JUDGE_MAX_TOKENS",
    )
    task_budget_seconds: float = _setting(
        600.0,
        "Seconds one task may spend on retries of 408/409/429/5xx/timeouts (honouring "
        "Retry-After and the x-ratelimit-reset headers); a task still unanswered is unjudged (status error).",
        env="FILTER_JUDGE_TASK_BUDGET",
    )
    reasoning_model: bool = _setting(
        False,
        "A reasoning model (o1-style): send max_completion_tokens instead of max_tokens, and no temperature.",
        env="FILTER_JUDGE_REASONING_MODEL",
    )
    structured_output: bool = _setting(
        True,
        "Ask for a JSON-schema reply (response_format); dropped by itself where the server rejects it.",
        env="FILTER_JUDGE_STRUCTURED_OUTPUT",
    )
    prompt_version: str = _setting(
        PROMPT_VERSION,
        "Part of the verdict cache key: change it to re-judge everything ("
        + " and ".join(f"`{v}`" for v in PROMPTS)
        + " pick their own prompt; any other name is the current prompt under a new key).",
        env="FILTER_JUDGE_PROMPT_VERSION",
    )
    min_score: int | None = _setting(
        None,
        f"A verdict passes only if the model passed it and its score ({SCORE_RANGE[0]}-{SCORE_RANGE[1]}, when it "
        "gave one) is at least this; unset: the model's verdict alone. Not part of the verdict cache key: changing "
        "it and materializing again asks nothing.",
        env="FILTER_JUDGE_MIN_SCORE",
        ge=SCORE_RANGE[0],
        le=SCORE_RANGE[1],
    )
    include_screenshot: bool = _setting(
        False,
        "Send the attempt's first and last screenshots, by natural order (multimodal models).",
        env="FILTER_JUDGE_SCREENSHOT",
    )
    max_prompt_chars: int = _setting(
        24_000,
        "Budget of one prompt's task text in characters (the fixed system prompt aside); "
        "long actions and page text keep their head and tail, the cut marked.",
    )
    save_every_verdicts: int = _setting(
        500,
        f"Save verdicts as they arrive, every this many (warehouse/{JUDGE_PROGRESS_FOLDER}/<run_id>/): "
        "a killed run's next materialization asks only what was not saved.",
        env="FILTER_JUDGE_SAVE_EVERY",
        ge=1,
    )
    save_every_seconds: float = _setting(
        30.0, "... or every this many seconds, whichever comes first.", env="FILTER_JUDGE_SAVE_SECONDS", ge=0
    )
    price_per_million_prompt_tokens: float = _setting(
        0.0,
        "Price of a million prompt tokens, for the cost in the metadata and the report "
        "(0 with the other prices: not priced).",
        env="FILTER_JUDGE_PRICE_PROMPT",
        ge=0,
    )
    price_per_million_completion_tokens: float = _setting(
        0.0, "Price of a million completion tokens.", env="FILTER_JUDGE_PRICE_COMPLETION", ge=0
    )
    price_per_million_cached_tokens: float | None = _setting(
        None,
        "Price of a million prompt tokens the endpoint served from its cache (unset: the prompt price).",
        env="FILTER_JUDGE_PRICE_CACHED",
        ge=0,
    )
    backoff_initial_seconds: float = _setting(
        0.5, "First wait before retrying a transient fault (doubled per retry).", gt=0
    )
    backoff_max_seconds: float = _setting(8.0, "Longest wait between two retries.", gt=0)

    def check(self) -> None:
        """Refuse, in one line, what the client cannot work with, before any request."""
        missing = [env_name(name) for name in ("base_url", "model") if not getattr(self, name)]
        if missing:
            raise ValueError(f"the llm judge needs {' and '.join(missing)}")
        _check_endpoint(self.base_url, self.api_key)
        if self.votes < 1:
            raise ValueError(f"judge {self._named('votes')}: at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # (JSON has no NaN: every request a 400)
            raise ValueError(f"judge {self._named('temperature')}: a number, 0 or more")
        if self.votes > 1 and self.temperature <= 0 and not self.reasoning_model:
            raise ValueError(
                f"judge {self._named('votes')} at {self._named('temperature')}: identical samples at temperature 0 "
                "cannot disagree; set votes=1, or a temperature above 0 (e.g. 0.7) for a majority of samples"
            )
        if self.concurrency < 1:
            raise ValueError(f"judge {self._named('concurrency')}: at least 1")
        if self.max_tokens < 0:
            raise ValueError(f"judge {self._named('max_tokens')}: 0 (not sent) or more")
        for name in ("task_budget_seconds", "timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"judge {self._named(name)}: must be above 0")

    def _named(self, field: str) -> str:
        """A setting as an error names it: its field and value, and the variable it came from when that is set
        (it may come from Dagster's config or a command's option instead)."""
        env = env_name(field)
        return f"{field}={getattr(self, field)}" + (f" ({env})" if env in os.environ else "")

    def identity(self) -> list:
        """What of the settings decides a verdict, for the cache key (with the prompt version and messages)."""
        return [self.model, self.votes, self.temperature]

    def settings_digest(self) -> str:
        """A short digest of every setting that enters a verdict's cache key (`prompt.cache_key`) besides the
        trajectory itself: the prompt version, `identity()`, and what shapes the messages (screenshot, size)."""
        material = [self.prompt_version, *self.identity(), self.include_screenshot, self.max_prompt_chars]
        return hashlib.sha256(json.dumps(material).encode()).hexdigest()[:16]

    def redact(self, text: str | None) -> str | None:
        """`text` with the API key, and the secrets of the base URL (`url_secrets`), replaced by ***: nothing the
        judge writes or raises carries them, even where the server repeats them in an error. A placeholder
        key (`is_placeholder_key`: EMPTY, none, ollama) is no secret and is left, or every "none" of the judge's
        reasoning would read ***."""
        if not text:
            return text
        secrets = {*([self.api_key] if isinstance(self.api_key, str) else []), *url_secrets(self.base_url)}
        for secret in sorted(secrets, key=len, reverse=True):  # (longest first)
            if secret and not is_placeholder_key(secret):
                text = text.replace(secret, "***")
        return text

    def redacted(self, text: str | None, max_chars: int, single_line: bool = False, cut_mark: str = "") -> str | None:
        """`text` redacted, then (made one line, `descriptions.one_line`, when `single_line`) cut to `max_chars` with
        `cut_mark` where it was cut. Redaction comes first: a key the cut splits would no longer be found whole."""
        text = self.redact(text)
        if text is None:
            return None
        if single_line:
            text = one_line(text)
        return text if len(text) <= max_chars else text[:max_chars] + cut_mark


# keys local servers take as "no key" (vLLM, Ollama, LM Studio, llama.cpp examples): no secret, and common words
PLACEHOLDER_KEYS = frozenset({"empty", "none", "null", "ollama", "dummy", "lm-studio", "not-needed", "no-key",
                              "sk-no-key-required", "token", "key", "x"})  # fmt: skip


# the words that name a query parameter of the base URL whose value is a secret (Azure's `api-key`, `?key=`,
# `access_token` or `accessToken`, a signed URL's `sig` or `X-Amz-Signature`), matched as whole words of the
# parameter's name (`_words`): `design` or `author` name none
_SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "sig", "signature", "password", "passwd", "pwd", "pass",
                           "auth", "authorization", "bearer", "credential", "credentials", "code"})  # fmt: skip


def _words(name: str) -> set[str]:
    """The words of a parameter's name, lower case: split at what is no letter or digit and where a capital
    follows a small letter or digit (`accessToken`: access, token)."""
    return set(re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()))


_SHORTEST_SECRET = 8  # (shorter values are words of any text: masking them would garble the judge's reasoning)


@functools.lru_cache(maxsize=8)
def url_secrets(base_url: str | None) -> tuple[str, ...]:
    """What of the base URL may be a secret, in each form a server may repeat it (as written, decoded, as the
    client sends it): its user part's password (or its name, when it has none: then the name is the token), the
    Basic credentials they are sent as, and the values of query parameters named as keys, tokens or
    signatures; `_SHORTEST_SECRET` characters or more each."""
    from yarl import URL  # (aiohttp's URL type: the forms it sends)

    try:
        sent = URL(base_url) if isinstance(base_url, str) else None
    except (ValueError, TypeError):
        return ()
    if sent is None:
        return ()
    found = [sent.password if sent.password is not None else sent.user, sent.raw_password, sent.raw_user]
    if sent.user is not None:
        try:  # (aiohttp encodes a URL's user part as latin-1)
            found.append(base64.b64encode(f"{sent.user}:{sent.password or ''}".encode("latin-1")).decode("ascii"))
        except UnicodeEncodeError:
            pass
    for query in (urlsplit(base_url).query, sent.raw_query_string):
        for parameter in query.split("&"):
            name, _, value = parameter.partition("=")
            if _SECRET_WORDS & _words(unquote_plus(name)):
                found += [value, unquote_plus(value), unquote(value)]
    # (longest first: a secret holding another is masked whole)
    return tuple(sorted({v for v in found if v and len(v) >= _SHORTEST_SECRET}, key=len, reverse=True))


def is_placeholder_key(key: str) -> bool:
    """Whether an API key is one of the placeholders a local server takes as "no key" (`PLACEHOLDER_KEYS`, in
    any case): the judge's words equal to it are no secret and stay."""
    return key.strip().lower() in PLACEHOLDER_KEYS


def _check_endpoint(base_url: str, api_key: str | None) -> None:
    """Refuse a base URL no request can reach and a key no header can carry, naming the variable and what is
    wrong, never their text (a URL may carry a token in its path or query, or be the key pasted by mistake)."""
    base_url, api_key = (
        value.get_value() if isinstance(value, dg.EnvVar) else value  # (not resolved yet: checked as it is read)
        for value in (base_url, api_key)
    )
    problem = _url_problem(base_url) if base_url is not None else "not set"
    if problem:
        raise ValueError(f"{env_name('base_url')} is not an http(s) URL such as http://127.0.0.1:8000/v1 ({problem})")
    if isinstance(api_key, str) and _not_header_text(api_key):
        raise ValueError(
            f"{env_name('api_key')} starts or ends with whitespace or holds a control character (a line break "
            "copied with it?): an HTTP header cannot carry it"
        )


def _url_problem(url: str) -> str | None:
    if _not_header_text(url):
        return "whitespace around it or a control character in it"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # (its message may quote part of the URL)
        return "a port that is not a number from 1 to 65535, or an unclosed [ around an IPv6 host"
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
    if not parts.hostname:
        return "no host"
    return "port 0" if port == 0 else None


def _not_header_text(text: str) -> bool:
    return text != text.strip() or not text.isprintable()


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


# settings whose text may hold a secret: the API key, and the base URL, which may carry a key in its path (a
# gateway's /k/<key>/v1), its query (?api-key=) or its user part, where no rule can tell it from a plain path
SECRET_SETTINGS = ("api_key", "base_url")


def config_from_env(overrides: dict | None = None, env_vars: bool = True) -> LLMJudgeConfig:
    """The LLM settings that FILTER_JUDGE_* variables give, `overrides` in their place. `env_vars`: the
    `SECRET_SETTINGS` are wired as EnvVar, so that Dagster resolves them in the run and shows the variable's
    name, never its value; False, as their values, for a process that asks the endpoint itself."""
    values: dict = {}
    for name, field in LLMJudgeConfig.model_fields.items():
        env = env_name(name)
        if env is None or env not in os.environ:
            continue
        if name in SECRET_SETTINGS:
            if os.environ[env]:
                values[name] = dg.EnvVar(env) if env_vars else os.environ[env]
            continue
        kind = next((t for t in _PARSERS if t in (field.annotation, *getattr(field.annotation, "__args__", ()))), str)
        parse, type_name = _PARSERS.get(kind, (str, "text"))
        try:
            values[name] = parse(os.environ[env])
        except ValueError:
            raise ValueError(f"{env}={os.environ[env]!r} is not a valid {type_name}") from None
    return LLMJudgeConfig(**{**values, **(overrides or {})})
