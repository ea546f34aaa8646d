"""Run config of the ledger step: per-site caps and per-macro targets (CONTRACT §3.6, §6 `--caps`).

`parse_caps` / `load_caps_file` are the one validation of a caps document, for the CLI, the sensor and
FILTER_PIPELINE_CAPS alike: strict (2, not "2", 2.0 or true), so that what passes them also passes Dagster's
run config check, and every error is one line naming the file and the field.
"""

import json
import os
from pathlib import Path
from typing import Any

import dagster as dg
import yaml
from pydantic import Field, ValidationError, create_model

from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline.rules.records import INT64_MAX
from filter_pipeline.rules.schemas import DEFAULT_PER_SITE_CAP
from filter_pipeline.settings import CAPS_ENV

CAP_MAX = INT64_MAX  # the walk counts in 64-bit integers


def _non_negative(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= CAP_MAX:
        raise ValueError(f"must be 0 or more, got {value}" if value < 0 else f"must be at most {CAP_MAX}, got {value}")
    return value


class MacroCapsConfig(dg.Config):
    """Limits for one macro (task template)."""

    site_cap: int | None = Field(
        default=None,
        strict=True,
        description="Most kept rows per site for this macro, history included (default: per_site_cap).",
    )
    target: int | None = Field(
        default=None,
        strict=True,
        description="Most kept rows for this macro over all sites, history included (default: none).",
    )


# Ranges are checked by `parse_caps` (each step that takes caps checks its run's config with it as it starts),
# not by validators here: Dagster builds this config before the step runs, where a validator's error would reach
# the user as pydantic's traceback instead of one line.
class CapsConfig(dg.Config):
    """Caps applied by the ledger walk. Counts include every earlier run's non-retired kept rows."""

    per_site_cap: int = Field(
        default=DEFAULT_PER_SITE_CAP,
        strict=True,
        description="Most kept rows per (macro, site), history included, for macros without their own site_cap.",
    )
    caps: dict[str, MacroCapsConfig] = Field(
        default={}, description="Per-macro limits: {macro: {site_cap, target}}; either may be left out."
    )

    def caps_document(self) -> dict:
        """The caps alone (a subclass's other fields left out), as the commit record keeps them."""
        return self.model_dump(include=set(CapsConfig.model_fields))

    def to_caps(self) -> Caps:
        return Caps(
            per_site_cap=self.per_site_cap,
            macros={m: MacroLimits(site_cap=c.site_cap, target=c.target) for m, c in self.caps.items()},
        )


def parse_caps(raw: Any, where: str) -> dict:
    """Validate a caps document ({"per_site_cap": 3, "caps": {...}}); returns it as run config (a key left
    empty, null, is left out: the default applies, as Dagster's run config treats it).

    Raises ValueError with one line naming `where` and the offending field.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping with 'per_site_cap' and/or 'caps'")
    raw = {key: value for key, value in raw.items() if value is not None}  # `per_site_cap:` left empty: not set
    unknown = set(raw) - set(CapsConfig.model_fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; allowed: per_site_cap, caps")
    macros = raw.get("caps")
    if macros is not None and not isinstance(macros, dict):
        raise ValueError(f"{where}: caps must be a mapping {{macro: {{site_cap, target}}}}, got {_shown(macros)}")
    for macro, limits in (macros or {}).items():
        if not isinstance(macro, str):
            raise ValueError(f"{where}: caps: macro name {_shown(macro)} must be a string (quote it)")
        if not isinstance(limits, dict):
            raise ValueError(f"{where}: caps.{macro} must be a mapping with site_cap and/or target")
        extra = set(limits) - set(MacroCapsConfig.model_fields)
        if extra:
            raise ValueError(f"{where}: caps.{macro} has unknown key(s) {', '.join(sorted(map(str, extra)))}")
    try:
        parsed = CapsConfig(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}: {field}: {first['msg']} (got {_shown(first['input'])})") from None
    limits = [("per_site_cap", parsed.per_site_cap)]
    limits += [
        (f"caps.{m}.{name}", getattr(c, name)) for m, c in parsed.caps.items() for name in ("site_cap", "target")
    ]
    for field, value in limits:
        try:
            _non_negative(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {field}: {exc}") from None
    return raw


def _shown(value: Any) -> str:
    """A value as the caps file wrote it (JSON), cut to one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (by default the last one silently wins)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    twice = key in seen
                except TypeError:  # not hashable: the safe loader says so itself
                    break
                if twice:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {_shown(key)} appears twice", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {_shown(key)} appears twice")
        seen[key] = value
    return seen


def _read_caps(text: str, path: Path) -> Any:
    """The document of a caps file: JSON for a `.json` file (tabs and all), else YAML (which JSON also is).
    Raises ValueError with one line: file, line, column and the problem."""
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text, object_pairs_hook=_unique_pairs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"caps file {path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
        except ValueError as exc:
            raise ValueError(f"caps file {path}: {exc}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(part for part in (exc.context, exc.problem) if part)
        kind = "" if isinstance(exc, yaml.constructor.ConstructorError) else "not YAML or JSON: "
        raise ValueError(f"caps file {where}: {kind}{problem}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"caps file {path}: not YAML or JSON: {one_line(exc)}") from None


def load_caps_file(path: str | Path) -> dict:
    """Read and validate a caps file: JSON when it is named `.json` (a key written twice refused), YAML otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"caps file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"caps file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    raw = _read_caps(text, path)
    return parse_caps({} if raw is None else raw, f"caps file {path}")


def caps_from_env() -> dict:
    """The deployment's caps: the caps file FILTER_PIPELINE_CAPS names, validated ({} when it is unset). Raises
    ValueError with one line that starts with the variable's name (the code location's load error, in the UI,
    says which setting to fix)."""
    path = os.environ.get(CAPS_ENV)
    if not path:
        return {}
    try:
        return load_caps_file(path)
    except ValueError as exc:
        raise ValueError(f"{CAPS_ENV}: {exc}") from None


# --- the deployment's caps as the run config's defaults ------------------------------------------------------

# the steps whose config holds caps (the launchpad shows them under ops.<op>.config)
LEDGER_OP, COVERAGE_OP = "ledger", "coverage"

CAPS_SOURCE_DEPLOYMENT = "deployment"
CAPS_SOURCE_RUN_CONFIG = "run config"


class LedgerConfig(CapsConfig):
    """Caps of the walk, and which failed attempts may be the rejected side of a DPO pair."""

    include_judge_failures: bool = Field(
        default=False,
        description="DPO pairs: also pair judge failures, whose backend gate passed (the judge and the gate "
        "disagree there). A task has one verdict, so a task with a judge failure was never kept: under this "
        "stage's rules there is no kept attempt to pair one with, and this adds no pair.",
    )


def deployment_caps_config(caps: dict, base: type[CapsConfig] = CapsConfig) -> type[CapsConfig]:
    """`base` (a CapsConfig) with the deployment's caps as its defaults (`caps`: a validated caps document,
    e.g. from FILTER_PIPELINE_CAPS; empty: the built-in defaults). The UI's launchpad scaffolds these
    defaults, and a run given no caps config (the sensor's, the CLI's without --caps) uses them."""
    if not caps:
        return base
    parsed = CapsConfig(**caps)
    macros = {m: c.model_dump(exclude_none=True) for m, c in parsed.caps.items()}
    fields = CapsConfig.model_fields
    return create_model(
        f"Deployment{base.__name__}",
        __base__=base,
        __doc__=base.__doc__ + " Defaults: the deployment's caps (FILTER_PIPELINE_CAPS).",
        per_site_cap=(
            int,
            Field(default=parsed.per_site_cap, strict=True, description=fields["per_site_cap"].description),
        ),
        caps=(
            dict[str, MacroCapsConfig],
            Field(default=macros, validate_default=True, description=fields["caps"].description),
        ),
    )


def caps_source(config: CapsConfig, deployment: dict) -> str:
    """Whether a run walks with the deployment's caps or with caps its run config changed."""
    same = config.to_caps() == CapsConfig(**deployment).to_caps()
    return CAPS_SOURCE_DEPLOYMENT if same else CAPS_SOURCE_RUN_CONFIG


def run_caps_problem(run_config: dict, ops: tuple[str, ...] = (LEDGER_OP, COVERAGE_OP)) -> str | None:
    """One line naming the first invalid caps in a run's config (ops.<op>.config), None if they are valid.
    Dagster checks only the types of run config at launch; ranges are checked here, by the first step of
    the run, before anything is written or judged. Only the caps are checked: the op's other settings
    (the ledger's include_judge_failures) are Dagster's to check."""
    for op in ops:
        raw = ((run_config.get("ops") or {}).get(op) or {}).get("config")
        if raw is None:
            continue
        try:
            parse_caps({k: v for k, v in raw.items() if k in CapsConfig.model_fields}, f"run config ops.{op}.config")
        except ValueError as exc:
            return str(exc)
    return None


def refuse_invalid_run_caps(context: dg.AssetExecutionContext) -> None:
    """Fail the step at once, with one line, when the run's config carries invalid caps (a negative cap from
    the launchpad): Dagster checks only their types at launch. Called first by every step that takes caps or
    runs before one that does, so nothing is parsed, judged or written with them."""
    problem = run_caps_problem(context.run.run_config or {})
    if problem is not None:
        raise dg.Failure(description=f"{problem}; nothing was judged, walked or written with them")
