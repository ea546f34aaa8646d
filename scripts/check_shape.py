"""The package's shape, checked from its source by `make lint` (so CI, which runs `make lint`, keeps it true).

    .venv/bin/python scripts/check_shape.py [PACKAGE_DIR]      # default: filter_pipeline/ beside this folder

One line per violation, then exit 1; silent with exit 0 when the shape holds:
- `rules/` is pure: it imports none of fcntl, threading, concurrent.futures, multiprocessing, asyncio,
  subprocess, socket, shutil, glob, tempfile, upath, fsspec, s3fs, calls no file function (builtin `open`,
  `os.open`/`os.replace`/`os.scandir`/..., `os.path.exists`/..., a path's `.open(`/`.read_bytes(`/`.iterdir(`/
  ...), reads no clock (`time.time`, `datetime.now`, ...) and no environment variable (`os.environ`,
  `os.getenv`), whatever name an import gives them (`from os import listdir`, `import datetime as dt`);
- no function (or method) is longer than MAX_FUNCTION_LINES lines, from its `def` to its last line;
- no `global` statement;
- no module is longer than MAX_MODULE_LINES lines;
- the dependencies in pyproject.toml (beside the package) are the ones it imports: every third-party module
  imported belongs to a runtime dependency or a deployment extra (or comes with one, `CARRIED`), and every
  runtime dependency is imported or serves a documented command (`SERVES`).
"""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
PURE_PACKAGE = "rules"  # the sub-package that takes data in and gives data out
# modules a pure rule never imports: files, locks, threads, processes, sockets, object stores
IMPURE_MODULES = ("fcntl", "threading", "concurrent.futures", "multiprocessing", "asyncio", "subprocess", "socket",
                  "shutil", "glob", "tempfile", "upath", "fsspec", "s3fs")  # fmt: skip
# functions of `os` and `os.path` that touch the file system
OS_FILE_CALLS = {
    "os": {"open", "close", "fsync", "replace", "rename", "remove", "unlink", "listdir", "scandir", "makedirs",
           "mkdir", "rmdir", "stat", "walk", "utime", "chmod", "link", "symlink", "truncate", "write", "read"},
    "os.path": {"exists", "isfile", "isdir", "getsize", "getmtime", "islink", "lexists"},
}  # fmt: skip
# clocks: a rule given the same data gives the same answer, so the time comes in as data
CLOCK_FUNCTIONS = {"time": {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"}}
CLOCK_CALLS = {f"time.{name}" for name in CLOCK_FUNCTIONS["time"]} | {
    "datetime.now", "datetime.utcnow", "datetime.today", "date.today", "datetime.datetime.now",
    "datetime.datetime.utcnow", "datetime.datetime.today", "datetime.date.today", "pd.Timestamp.now",
    "pd.Timestamp.utcnow", "pd.Timestamp.today", "pandas.Timestamp.now", "pandas.Timestamp.utcnow",
    "pandas.Timestamp.today", "Timestamp.now",
}  # fmt: skip
# methods of a path object (pathlib, UPath) that touch the file system: `path.open(...)`, `path.iterdir()`
PATH_FILE_METHODS = {"open", "read_bytes", "read_text", "write_bytes", "write_text", "iterdir", "rglob", "mkdir",
                     "unlink", "rmdir", "touch"}  # fmt: skip
# runtime dependencies no module imports, and what each serves instead
SERVES = {"dagster-webserver": "the UI of `dagster dev`"}
# third-party modules imported that come with a declared dependency rather than one of their own
CARRIED = {"botocore": "s3fs (the s3 extra)"}
# the extras a deployment installs (the test extra is not for the package's own imports)
DEPLOYMENT_EXTRAS = ("s3", "postgres", "k8s")
# the environment: a rule's settings come in as arguments
ENVIRONMENT = {"os.environ", "os.getenv", "os.environb", "os.putenv"}


def _impure(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in IMPURE_MODULES)


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """The module or object each name an import binds stands for: `dt` -> `datetime` for `import datetime as
    dt`, `listdir` -> `os.listdir` for `from os import listdir`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname: alias.name for alias in node.names if alias.asname}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str:
    """`os.path.exists` for the expression naming it, its first name as the import binding it stands for; ""
    for anything else."""
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _file_call(call: ast.Call, names: dict[str, str]) -> str | None:
    """The name of the file function `call` calls, if it calls one."""
    name = _dotted(call.func, names)
    if name == "open":
        return "open("
    if isinstance(call.func, ast.Attribute) and call.func.attr in PATH_FILE_METHODS and not name.startswith("os."):
        return f".{call.func.attr}("
    owner, _, function = name.rpartition(".")
    return name if function in OS_FILE_CALLS.get(owner, ()) else None


def _purity(tree: ast.Module, where: str) -> list[str]:
    """`rules/`'s violations in one module."""
    found, names = [], _imported_names(tree)
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for module in dict.fromkeys(m for m in modules if _impure(m)):
            found.append(
                f"{where}:{node.lineno}: imports {module} ({PURE_PACKAGE}/ must not touch files, locks or threads)"
            )
            break
        found += _impure_use(node, names, where)
    return found


def _impure_use(node: ast.AST, names: dict[str, str], where: str) -> list[str]:
    """The file calls, clock reads and environment reads of one node of a `rules/` module."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in (*CLOCK_FUNCTIONS, *OS_FILE_CALLS):
        clocks, files = CLOCK_FUNCTIONS.get(node.module, ()), OS_FILE_CALLS.get(node.module, ())
        return [
            f"{where}:{node.lineno}: imports {node.module}.{alias.name} ({PURE_PACKAGE}/ must not "
            f"{'read clocks' if alias.name in clocks else 'touch files'})"
            for alias in node.names
            if alias.name in clocks or alias.name in files
        ]
    if isinstance(node, ast.Call) and (call := _file_call(node, names)):
        return [f"{where}:{node.lineno}: calls {call} ({PURE_PACKAGE}/ must not touch files)"]
    if isinstance(node, ast.Call):
        # as written (`pd.Timestamp.now`) or as its import names it (`datetime.datetime.now` for `dt.datetime.now`)
        written, resolved = _dotted(node.func, {}), _dotted(node.func, names)
        clock = written if written in CLOCK_CALLS else resolved if resolved in CLOCK_CALLS else None
        if clock:
            return [f"{where}:{node.lineno}: calls {clock} ({PURE_PACKAGE}/ must not read clocks)"]
    if isinstance(node, (ast.Attribute, ast.Name)) and _dotted(node, names) in ENVIRONMENT:
        return [f"{where}:{node.lineno}: reads {_dotted(node, names)} ({PURE_PACKAGE}/ must not read the environment)"]
    return []


def module_violations(source: str, where: str, pure: bool) -> list[str]:
    """The violations in one module's `source` (`where`: its path, as messages name it)."""
    lines = source.count("\n") + (0 if source.endswith("\n") or not source else 1)
    found = [f"{where}: {lines} lines (at most {MAX_MODULE_LINES})"] if lines > MAX_MODULE_LINES else []
    tree = ast.parse(source, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno}: {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
        elif isinstance(node, ast.Global):
            found.append(f"{where}:{node.lineno}: global {', '.join(node.names)} (no global statements)")
    found += _purity(tree, where) if pure else []
    return sorted(found, key=lambda line: int(line.split(":")[1]) if line.split(":")[1].isdigit() else 0)


def violations(package: Path) -> list[str]:
    """Every violation in the package at `package`, sorted by file, each as one line."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        where = str(Path(package.name) / relative)
        found += module_violations(path.read_text(), where, pure=relative.parts[0] == PURE_PACKAGE)
    return found


def _distribution(requirement: str) -> str:
    """`pyyaml` for `PyYAML>=6,<7`: a distribution's name as pip compares them."""
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def _third_party_imports(package: Path) -> dict[str, str]:
    """Each third-party top-level module the package imports, with the first place that imports it."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            for top in (m.split(".")[0] for m in modules):
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, f"{package.name}/{path.relative_to(package)}:{node.lineno}")
    return found


def dependency_violations(package: Path) -> list[str]:
    """What the package imports without declaring it, and the runtime dependencies it declares for nothing
    (nothing for a package with no pyproject.toml beside it)."""
    if not (package.parent / "pyproject.toml").exists():
        return []
    project = tomllib.loads((package.parent / "pyproject.toml").read_text())["project"]
    runtime = {_distribution(r) for r in project["dependencies"]}
    extras = project.get("optional-dependencies", {})
    declared = runtime | {_distribution(r) for name in DEPLOYMENT_EXTRAS for r in extras.get(name, ())}
    owners = packages_distributions()
    found, used = [], set()
    for module, where in _third_party_imports(package).items():
        distributions = {_distribution(d) for d in owners.get(module, [module])}
        used |= distributions
        if not distributions & declared and module not in CARRIED:
            found.append(f"{where}: imports {module}, which no dependency in pyproject.toml declares")
    found += [
        f"pyproject.toml: {name} is a runtime dependency the package never imports (nor serves a command: SERVES)"
        for name in sorted(runtime - used - set(SERVES))
    ]
    return found


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "filter_pipeline"
    found = violations(package) + dependency_violations(package)
    for line in found:
        print(line)
    if found:
        print(f"check_shape: {len(found)} violation(s) of the package's shape (scripts/check_shape.py)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
