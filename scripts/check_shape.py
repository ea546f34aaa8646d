"""The package's shape, checked from its source by `make lint` (so CI, which runs `make lint`, keeps it true).

    .venv/bin/python scripts/check_shape.py [PACKAGE_DIR]      # default: filter_pipeline/ beside this folder

One line per violation, then exit 1; silent with exit 0 when the shape holds:
- `rules/` is pure: it imports none of fcntl, threading, concurrent.futures, upath, fsspec, s3fs, and calls no
  file function (builtin `open`, `os.open`/`os.replace`/`os.scandir`/..., `os.path.exists`/..., a path's
  `.open(`/`.read_bytes(`/`.iterdir(`/...) and reads no clock (`time.time`, `datetime.now`, ...);
- no function (or method) is longer than MAX_FUNCTION_LINES lines, from its `def` to its last line;
- no `global` statement;
- no module is longer than MAX_MODULE_LINES lines.
"""

import ast
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
PURE_PACKAGE = "rules"  # the sub-package that takes data in and gives data out
# modules a pure rule never imports: files, locks, threads, object stores
IMPURE_MODULES = ("fcntl", "threading", "concurrent.futures", "upath", "fsspec", "s3fs")
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
    "datetime.datetime.utcnow", "pd.Timestamp.now", "pd.Timestamp.utcnow", "pandas.Timestamp.now", "Timestamp.now",
}  # fmt: skip
# methods of a path object (pathlib, UPath) that touch the file system: `path.open(...)`, `path.iterdir()`
PATH_FILE_METHODS = {"open", "read_bytes", "read_text", "write_bytes", "write_text", "iterdir", "rglob", "mkdir",
                     "unlink", "rmdir", "touch"}  # fmt: skip


def _impure(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in IMPURE_MODULES)


def _dotted(node: ast.AST) -> str:
    """`os.path.exists` for the expression naming it; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _file_call(call: ast.Call) -> str | None:
    """The name of the file function `call` calls, if it calls one."""
    name = _dotted(call.func)
    if name == "open":
        return "open("
    if isinstance(call.func, ast.Attribute) and call.func.attr in PATH_FILE_METHODS and not name.startswith("os."):
        return f".{call.func.attr}("
    owner, _, function = name.rpartition(".")
    return name if function in OS_FILE_CALLS.get(owner, ()) else None


def _purity(tree: ast.Module, where: str) -> list[str]:
    """`rules/`'s violations in one module."""
    found = []
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
        if isinstance(node, ast.Call) and (call := _file_call(node)):
            found.append(f"{where}:{node.lineno}: calls {call} ({PURE_PACKAGE}/ must not touch files)")
        if isinstance(node, ast.ImportFrom) and node.module in CLOCK_FUNCTIONS:
            for alias in node.names:
                if alias.name in CLOCK_FUNCTIONS[node.module]:
                    found.append(
                        f"{where}:{node.lineno}: imports {node.module}.{alias.name} ({PURE_PACKAGE}/ must not read clocks)"
                    )
        if isinstance(node, ast.Call) and _dotted(node.func) in CLOCK_CALLS:
            found.append(f"{where}:{node.lineno}: calls {_dotted(node.func)} ({PURE_PACKAGE}/ must not read clocks)")
    return found


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


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "filter_pipeline"
    found = violations(package)
    for line in found:
        print(line)
    if found:
        print(f"check_shape: {len(found)} violation(s) of the package's shape (scripts/check_shape.py)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
