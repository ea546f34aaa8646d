"""The deployment files and the README's S3 walkthrough. No Kubernetes cluster or Docker engine runs here,
so the Dockerfile and the Helm values are checked as far as they can be: they parse, and every name in them
(image, module, attribute, extras, env settings, run queue) is one that exists, and no pool is configured."""

import contextlib
import importlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import tomllib

import dagster as dg
import pytest
import setuptools
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from filter_pipeline.definitions import EXECUTOR_ENV, EXECUTORS, defs_from_env
from filter_pipeline.judge import resource as judging
from filter_pipeline.shell import warehouse
from filter_pipeline_tests.conftest import REPO
from filter_pipeline_tests.servers import free_port

DEPLOY = REPO / "deploy"


def dockerfile() -> dict:
    """The Dockerfile's instructions: {"COPY": [[src.., dest]], "RUN": [...], "CMD": [...], "LABEL": {...}}."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out: dict = {"COPY": [], "RUN": [], "LABEL": {}}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword == "CMD":
            out["CMD"] = yaml.safe_load(rest)  # the exec form is a JSON array
        elif keyword == "LABEL":
            out["LABEL"].update(dict(part.split("=", 1) for part in shlex.split(rest)))
        elif keyword in ("COPY", "RUN"):
            out[keyword].append(shlex.split(rest) if keyword == "COPY" else rest)
    return out


def helm_values() -> dict:
    return yaml.safe_load((DEPLOY / "helm-values.yaml").read_text())


def grpc_target(args: list[str]) -> tuple[str, str]:
    """(module, attribute) from `dagster api grpc` arguments."""
    flags = {flag: value for flag, value in zip(args, args[1:]) if flag.startswith("-")}
    return flags.get("-m") or flags.get("--module-name"), flags.get("-a") or flags.get("--attribute")


def test_the_dockerfile_serves_the_packages_definitions_and_copies_what_exists():
    docker = dockerfile()
    cmd = docker["CMD"]
    assert cmd[:3] == ["dagster", "api", "grpc"]
    module, attribute = grpc_target(cmd[3:])
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert module == project["tool"]["dagster"]["module_name"] == "filter_pipeline.definitions"
    assert isinstance(getattr(importlib.import_module(module), attribute), dg.Definitions)
    for *sources, _dest in docker["COPY"]:
        for source in sources:
            assert (REPO / source).exists(), source
    [install] = [r for r in docker["RUN"] if "pip install" in r]
    extras = re.search(r"\.\[([a-z0-9_,]+)\]", install).group(1).split(",")
    assert set(extras) == {"s3", "postgres", "k8s"} and set(extras) <= set(project["project"]["optional-dependencies"])


def test_the_image_installs_every_package_folder_at_the_pinned_versions():
    docker = dockerfile()
    copied = {source for *sources, _dest in docker["COPY"] for source in sources}
    assert {"pyproject.toml", "filter_pipeline", "constraints/py311.txt"} <= copied
    [install] = [r for r in docker["RUN"] if "pip install" in r]
    assert "-c constraints/py311.txt" in install
    # what `pip install .` puts in the image: the packages setuptools finds under pyproject's include
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = set(setuptools.find_packages(where=str(REPO), include=find["include"], exclude=find["exclude"]))
    folders = {".".join(path.parent.relative_to(REPO).parts) for path in (REPO / "filter_pipeline").rglob("*.py")}
    assert folders and folders <= installed, (
        f"folders without __init__.py are left out of the image: {folders - installed}"
    )


def test_the_helm_deployment_is_the_workspaces_code_location():
    [deployment] = helm_values()["dagster-user-deployments"]["deployments"]
    [entry] = yaml.safe_load((REPO / "workspace.yaml").read_text())["load_from"]
    location = entry["python_module"]["location_name"]
    # the chart names the location and its Service after `name`, and a Service name allows no underscore
    assert deployment["name"] == location.replace("_", "-")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", deployment["name"])
    module = entry["python_module"]
    assert grpc_target(deployment["dagsterApiGrpcArgs"]) == (module["module_name"], module["attribute"])


def test_the_deploy_files_point_only_at_files_and_sections_that_exist():
    def sections(doc: str) -> set[str]:
        return set(re.findall(r"^#+ (?:\d+\. )?(.+?)\s*$", (REPO / doc).read_text(), re.M))

    for path in DEPLOY.iterdir():
        text = path.read_text()
        for file in re.findall(r"\b((?:docs|deploy|constraints|instance)/[\w.-]+\.\w+)", text):
            assert (REPO / file).exists(), (path.name, file)
        for section, doc in re.findall(r'"([^"]+)" section of (README\.md|docs/[\w.-]+\.md)', text):
            assert section in sections(doc), (path.name, doc, section)
        assert not re.search(r"README's \"|\(README, ", text), (
            f"{path.name}: cite a README section as '\"X\" section of README.md'"
        )


def test_the_helm_values_name_the_image_and_module_the_dockerfile_builds():
    values, docker = helm_values(), dockerfile()
    [deployment] = values["dagster-user-deployments"]["deployments"]
    assert values["dagster-user-deployments"]["enabled"] is True
    assert deployment["image"]["repository"].rsplit("/", 1)[-1] == docker["LABEL"]["org.opencontainers.image.title"]
    assert grpc_target(deployment["dagsterApiGrpcArgs"]) == grpc_target(docker["CMD"][3:])
    assert deployment["port"] == int(docker["CMD"][docker["CMD"].index("-p") + 1])
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True  # run pods get the same env
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert set(values["runLauncher"]["config"]) == {"k8sRunLauncher"}
    assert values["dagsterDaemon"]["runCoordinator"]["type"] == "QueuedRunCoordinator"


def test_every_env_the_helm_values_set_is_a_setting_the_code_reads_or_the_readme_documents():
    [deployment] = helm_values()["dagster-user-deployments"]["deployments"]
    names = {e["name"] for e in deployment["env"]}
    settings = {warehouse.DATA_ENV, warehouse.ENDPOINT_ENV, EXECUTOR_ENV, *judging.ENV.values()}
    # read by a library, not by this code: the README's Configuration table must say what it does
    configuration = (REPO / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    library_settings = {name for name in names - settings if f"`{name}=" in configuration}
    assert names <= settings | library_settings, names - settings - library_settings
    assert warehouse.DATA_ENV in names
    values = {e["name"]: e["value"] for e in deployment["env"]}
    assert values[warehouse.DATA_ENV].startswith("s3://")
    assert values[EXECUTOR_ENV] in EXECUTORS
    assert judging.ENV["api_key"] not in names  # the key comes from a Secret, never from the values file


def test_the_run_queue_matches_the_local_instance_everywhere_and_no_pool_is_left_configured():
    local = yaml.safe_load((REPO / "instance" / "dagster.yaml").read_text())["concurrency"]
    postgres = yaml.safe_load((DEPLOY / "dagster-postgres.yaml").read_text())
    helm = helm_values()["concurrency"]
    assert postgres["concurrency"] == local
    assert helm["enabled"] is True
    assert helm["runs"] == {"maxConcurrentRuns": local["runs"]["max_concurrent_runs"]}
    defs = defs_from_env()
    pools = {defs.resolve_assets_def(s.key).op.pool for s in defs.resolve_all_asset_specs()} - {None}
    assert pools == set() and "pools" not in local and "pools" not in helm  # the ledger's exclusion is its lease


def test_the_stored_log_level_matches_the_local_instance_everywhere():
    local = yaml.safe_load((REPO / "instance" / "dagster.yaml").read_text())["python_logs"]
    postgres = yaml.safe_load((DEPLOY / "dagster-postgres.yaml").read_text())["python_logs"]
    assert local == postgres == {"python_log_level": "INFO"}
    assert helm_values()["pythonLogs"] == {"pythonLogLevel": local["python_log_level"]}


def test_the_postgres_instance_file_reads_every_connection_setting_from_the_environment():
    db = yaml.safe_load((DEPLOY / "dagster-postgres.yaml").read_text())["storage"]["postgres"]["postgres_db"]
    envs = {k: v["env"] for k, v in db.items() if isinstance(v, dict)}
    assert set(envs) == {"hostname", "port", "username", "password", "db_name"}
    assert all(name.startswith("DAGSTER_PG_") for name in envs.values())


@pytest.mark.slow
def test_readme_s3_walkthrough(tmp_path):
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- walkthrough: s3 -->\n```sh\n", 1)[1].split("```", 1)[0]
    port = str(free_port())
    (tmp_path / "home").mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", tmp_path / "home" / "dagster.yaml")
    script = block.replace("9000", port).replace("$PWD/.dagster_home", str(tmp_path / "home"))
    script = script.replace("> moto.log", f"> {tmp_path / 'moto.log'}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FILTER_", "DAGSTER_"))}
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,  # the backgrounded server goes down with the group
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        # (the group may be gone already: the block ends by stopping its server, and communicate reaped the shell)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^2026-11-28: judged \d+, unjudged 0, kept \d+", out, re.M), out[-4000:]
    assert re.search(r"^\d+ +2026-11-29 +\S+ +\S+$", out, re.M), out[-4000:]  # a kept row read back from S3


def _pins(path) -> dict[str, Version]:
    """name -> pinned version of a constraints file (names canonical, as pip compares them)."""
    pins = {}
    for line in (REPO / path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            [spec] = requirement.specifier
            assert spec.operator == "==", f"{path}: {line} is not a pin"
            pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def _requirements() -> list[Requirement]:
    """Every requirement pyproject.toml names, the extras' included (this package's own self-references not)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [r for r in map(Requirement, lines) if canonicalize_name(r.name) != canonicalize_name(project["name"])]


def test_the_constraints_pin_every_requirement_within_its_range():
    newest, oldest = _pins("constraints/py311.txt"), _pins("constraints/dagster-1.12.txt")
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        assert name in newest, f"{requirement.name} is not in constraints/py311.txt: run `make constraints`"
        assert newest[name] in requirement.specifier, f"constraints/py311.txt: {name}=={newest[name]} vs {requirement}"
        if name in oldest:
            assert oldest[name] in requirement.specifier, f"constraints/dagster-1.12.txt: {name} vs {requirement}"
    # the oldest file is the floor of the dagster range
    [dagster] = [r for r in _requirements() if r.name == "dagster"]
    assert not dagster.specifier.contains(Version(f"{oldest['dagster'].major}.{oldest['dagster'].minor - 1}.99"))
