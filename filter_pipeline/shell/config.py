"""Run config of the ledger step: per-site caps and per-macro targets (CONTRACT §3.5, §5 `--caps`)."""

from pathlib import Path
from typing import Any, Optional

import dagster as dg
import yaml
from pydantic import Field, ValidationError, create_model, field_validator

from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline.rules.schemas import DEFAULT_PER_SITE_CAP

CAPS_ENV = "FILTER_PIPELINE_CAPS"


def _non_negative(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


class MacroCapsConfig(dg.Config):
    """Limits for one macro (task template)."""

    site_cap: Optional[int] = Field(
        default=None, description="Most kept rows per site for this macro, history included (default: per_site_cap)."
    )
    target: Optional[int] = Field(
        default=None, description="Most kept rows for this macro over all sites, history included (default: none)."
    )

    @field_validator("site_cap", "target")
    @classmethod
    def _non_negative(cls, value: Optional[int]) -> Optional[int]:
        return _non_negative(value)


class CapsConfig(dg.Config):
    """Caps applied by the ledger walk. Counts include every earlier run's non-retired kept rows."""

    per_site_cap: int = Field(
        default=DEFAULT_PER_SITE_CAP,
        description="Most kept rows per (macro, site), history included, for macros without their own site_cap.",
    )
    caps: dict[str, MacroCapsConfig] = Field(
        default={}, description="Per-macro limits: {macro: {site_cap, target}}; either may be left out."
    )

    @field_validator("per_site_cap")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        return _non_negative(value)

    def to_caps(self) -> Caps:
        return Caps(
            per_site_cap=self.per_site_cap,
            macros={m: MacroLimits(site_cap=c.site_cap, target=c.target) for m, c in self.caps.items()},
        )


def parse_caps(raw: Any, where: str) -> dict:
    """Validate a caps document ({"per_site_cap": 3, "caps": {...}}); returns it as run config.

    Raises ValueError with one line naming `where` and the offending field.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping with 'per_site_cap' and/or 'caps'")
    unknown = set(raw) - set(CapsConfig.model_fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: per_site_cap, caps")
    for macro, limits in (raw.get("caps") or {}).items():
        if not isinstance(limits, dict):
            raise ValueError(f"{where}: caps.{macro} must be a mapping with site_cap and/or target")
        extra = set(limits) - set(MacroCapsConfig.model_fields)
        if extra:
            raise ValueError(f"{where}: caps.{macro} has unknown key(s) {', '.join(sorted(extra))}")
    try:
        CapsConfig(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}: {field}: {first['msg']}") from None
    return raw


def load_caps_file(path: str | Path) -> dict:
    """Read and validate a YAML or JSON caps file (JSON is YAML, so one parser reads both)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"caps file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"caps file {path}: not YAML or JSON ({exc})") from None
    return parse_caps({} if raw is None else raw, f"caps file {path}")



# --- the deployment's caps as the run config's defaults ------------------------------------------------------

CAPS_SOURCE_DEPLOYMENT = "deployment"
CAPS_SOURCE_RUN_CONFIG = "run config"


def deployment_caps_config(caps: dict) -> type[CapsConfig]:
    """A CapsConfig whose defaults are the deployment's caps (`caps`: a validated caps document, e.g. from
    FILTER_PIPELINE_CAPS; empty: the built-in defaults). The UI's launchpad scaffolds these defaults, and a
    run given no caps config (the sensor's, the CLI's without --caps) uses them."""
    if not caps:
        return CapsConfig
    parsed = CapsConfig(**caps)
    macros = {m: c.model_dump(exclude_none=True) for m, c in parsed.caps.items()}
    return create_model(
        "DeploymentCapsConfig",
        __base__=CapsConfig,
        __doc__=CapsConfig.__doc__ + " Defaults: the deployment's caps (FILTER_PIPELINE_CAPS).",
        per_site_cap=(int, Field(default=parsed.per_site_cap, description=CapsConfig.model_fields["per_site_cap"].description)),
        caps=(dict[str, MacroCapsConfig], Field(default=macros, validate_default=True, description=CapsConfig.model_fields["caps"].description)),
    )


def caps_source(config: CapsConfig, deployment: dict) -> str:
    """Whether a run walks with the deployment's caps or with caps its run config changed."""
    same = config.to_caps() == CapsConfig(**deployment).to_caps()
    return CAPS_SOURCE_DEPLOYMENT if same else CAPS_SOURCE_RUN_CONFIG


def run_caps_problem(run_config: dict, ops: tuple[str, ...] = ("ledger", "coverage")) -> str | None:
    """One line naming the first invalid caps in a run's config (ops.<op>.config), None if they are valid.
    Dagster checks only the types of run config at launch; ranges are checked here, by the first step of
    the run, before anything is written or judged."""
    for op in ops:
        raw = ((run_config.get("ops") or {}).get(op) or {}).get("config")
        if raw is None:
            continue
        try:
            parse_caps(raw, f"run config ops.{op}.config")
        except ValueError as exc:
            return str(exc)
    return None
