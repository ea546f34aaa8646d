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


def test_a_file_clock_or_environment_read_in_rules_is_found_under_whatever_name_an_import_gives_it(tmp_path):
    package = tmp_path / "pkg"
    write(
        package,
        "rules/renamed.py",
        """\
        import datetime as dt
        import os as system
        import shutil
        from os import environ, listdir
        from os.path import exists as there
        from datetime import date
        import pandas as pd

        def walk(frame, path):
            return frame, dt.datetime.now(), listdir(path), there(path), environ["X"], system.getenv("Y")

        def stamp(frame):
            return frame.assign(day=date.today(), at=pd.Timestamp.utcnow())
        """,
    )
    assert check_shape.violations(package) == [
        "pkg/rules/renamed.py:3: imports shutil (rules/ must not touch files, locks or threads)",
        "pkg/rules/renamed.py:4: imports os.listdir (rules/ must not touch files)",
        "pkg/rules/renamed.py:5: imports os.path.exists (rules/ must not touch files)",
        "pkg/rules/renamed.py:10: calls datetime.datetime.now (rules/ must not read clocks)",
        "pkg/rules/renamed.py:10: calls os.listdir (rules/ must not touch files)",
        "pkg/rules/renamed.py:10: calls os.path.exists (rules/ must not touch files)",
        "pkg/rules/renamed.py:10: reads os.environ (rules/ must not read the environment)",
        "pkg/rules/renamed.py:10: reads os.getenv (rules/ must not read the environment)",
        "pkg/rules/renamed.py:13: calls date.today (rules/ must not read clocks)",
        "pkg/rules/renamed.py:13: calls pd.Timestamp.utcnow (rules/ must not read clocks)",
    ]


def test_a_module_imported_undeclared_and_a_runtime_dependency_never_imported_are_each_one_line(tmp_path):
    package = tmp_path / "pkg"
    write(package, "rules/walk.py", "import numpy as np\nimport pandas.api\nfrom yaml import safe_load\n")
    write(package, "storage/s3.py", "def codes():\n    from botocore.exceptions import ClientError\n")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "pkg"\ndependencies = ["pandas>=3", "PyYAML>=6,<7", "orjson>=3", "dagster-webserver"]\n'
        '[project.optional-dependencies]\ns3 = ["s3fs"]\n'
    )
    assert check_shape.dependency_violations(package) == [
        "pkg/rules/walk.py:1: imports numpy, which no dependency in pyproject.toml declares",
        "pyproject.toml: orjson is a runtime dependency the package never imports (nor serves a command: SERVES)",
    ]
    assert check_shape.dependency_violations(REPO / "filter_pipeline") == []
