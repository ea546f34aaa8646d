"""scripts/check_shape.py, the package-shape check `make lint` runs: each kind of violation is reported in one
line naming the file and line, and a package in shape passes."""

import importlib.util
import subprocess
import sys
import textwrap

from filter_pipeline_tests.conftest import REPO

SCRIPT = REPO / "scripts" / "check_shape.py"
_spec = importlib.util.spec_from_file_location("check_shape", SCRIPT)
check_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_shape)


def write(package, relative: str, source: str) -> None:
    path = package / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def long_function(name: str, lines: int) -> str:
    return f"def {name}():\n" + "    x = 1\n" * (lines - 1)


def test_a_package_in_shape_passes(tmp_path):
    package = tmp_path / "pkg"
    write(package, "rules/walk.py", "import pandas as pd\n\n\ndef walk(frame):\n    return frame.head(1)\n")
    write(package, "shell/io.py", "import os\nimport threading\n\n\ndef save(path):\n    os.replace(path, path)\n")
    write(package, "shell/long.py", long_function("exactly_sixty", 60))
    assert check_shape.violations(package) == []
    done = subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "")


def test_each_violation_is_one_line_naming_its_place(tmp_path):
    package = tmp_path / "pkg"
    write(
        package,
        "rules/impure.py",
        """\
        import os
        import threading
        from concurrent.futures import ThreadPoolExecutor
        from upath import UPath
        import fsspec.utils
        from fcntl import flock

        def read(path):
            with open(path) as f:
                return f.read(), os.listdir(path), os.path.exists(path), UPath(path).read_bytes()

        def stamp(frame):
            return frame.assign(at=datetime.now(UTC), took=time.perf_counter(), day=pd.Timestamp.now())
        from time import monotonic_ns
        """,
    )
    write(package, "shell/state.py", "counter = 0\n\n\ndef bump():\n    global counter\n    counter += 1\n")
    write(package, "shell/long.py", long_function("sixty_one", 61))
    write(package, "cli/big.py", "x = 1\n" * 501)
    # the same imports outside rules/ are allowed
    write(package, "storage/lease.py", "import fcntl\nimport threading\n\n\ndef hold(f):\n    return open(f)\n")
    assert check_shape.violations(package) == [
        "pkg/cli/big.py: 501 lines (at most 500)",
        "pkg/rules/impure.py:2: imports threading (rules/ must not touch files, locks or threads)",
        "pkg/rules/impure.py:3: imports concurrent.futures (rules/ must not touch files, locks or threads)",
        "pkg/rules/impure.py:4: imports upath (rules/ must not touch files, locks or threads)",
        "pkg/rules/impure.py:5: imports fsspec.utils (rules/ must not touch files, locks or threads)",
        "pkg/rules/impure.py:6: imports fcntl (rules/ must not touch files, locks or threads)",
        "pkg/rules/impure.py:9: calls open( (rules/ must not touch files)",
        "pkg/rules/impure.py:10: calls os.listdir (rules/ must not touch files)",
        "pkg/rules/impure.py:10: calls os.path.exists (rules/ must not touch files)",
        "pkg/rules/impure.py:10: calls .read_bytes( (rules/ must not touch files)",
        "pkg/rules/impure.py:13: calls datetime.now (rules/ must not read clocks)",
        "pkg/rules/impure.py:13: calls time.perf_counter (rules/ must not read clocks)",
        "pkg/rules/impure.py:13: calls pd.Timestamp.now (rules/ must not read clocks)",
        "pkg/rules/impure.py:14: imports time.monotonic_ns (rules/ must not read clocks)",
        "pkg/shell/long.py:1: sixty_one is 61 lines (at most 60)",
        "pkg/shell/state.py:5: global counter (no global statements)",
    ]
    done = subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1].startswith("check_shape: 16 violation(s)")
