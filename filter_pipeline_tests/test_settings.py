"""Process settings taken from the environment before pyarrow loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from filter_pipeline.settings import ALLOCATOR_ENV
from filter_pipeline_tests.conftest import REPO

# what the kernel says of this process once pyarrow has loaded (and its allocator with it)
THP_AFTER_PYARROW_LOADS = """
import sys
if sys.argv[1] == "package":
    import filter_pipeline  # what every entry point (CLI, code location, run worker) imports first
import pyarrow
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("THP_enabled:")))
"""


def thp_enabled(imported: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    return subprocess.run(
        [sys.executable, "-c", THP_AFTER_PYARROW_LOADS, imported], cwd=REPO, env={**clean, **env},
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


@pytest.mark.skipif(
    not Path("/proc/self/status").exists() or "THP_enabled:" not in Path("/proc/self/status").read_text(),
    reason="the kernel does not report transparent huge pages per process",
)
def test_arrows_allocator_runs_without_transparent_huge_pages_once_the_package_is_imported_first():
    assert thp_enabled("package") == "0"
    assert thp_enabled("pyarrow only") == "1"  # mimalloc's default, which the package changes
    assert thp_enabled("package", MIMALLOC_ALLOW_THP="1") == "1"  # a value the user set wins
