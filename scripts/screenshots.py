"""Screenshots of the Dagster UI and the review app for the README, taken from a real `dagster dev` over the
sample data and `filter-pipeline review` over what it filtered.

    .venv/bin/python scripts/screenshots.py [--out docs/images] [--chromium PATH] [--install]

Copies the sample batches (`data/runs`, `data/labels.jsonl`) to a temp data root, starts `dagster dev` on
it (temp DAGSTER_HOME, free loopback port), lets the batch sensor filter them, then photographs three
pages with headless Chromium:

- `asset-graph.png`: the lineage around `kept`, by group: batch -> judging -> ledger -> training, reports;
- `kept-partitions.png`: the `kept` asset's partitions (one per run_id);
- `filter-report.png`: the latest `filter_report` materialization, with its funnel chart;

then four of the review app (`REVIEW_PAGES`): the runs, the latest run's tasks, a task's story, the queue.

Needs a Chromium binary (Debian: `apt-get install -y chromium`); `--install` runs that apt-get itself when
none is found, otherwise the script installs nothing. Exit status 1 with one line when a step fails.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from filter_pipeline_tests.dagster_dev import DagsterDev  # noqa: E402

WINDOW = "1400,900"
FILTER_SECONDS = 300
# the UI is a JS app that keeps polling: give it this much virtual time to fetch and lay out each page
VIRTUAL_TIME_MS = 20000
MAX_BYTES = 300_000
REVIEW_TASK = "2026-11-29-t004"  # a duplicate: its story links the task that kept the key first
REVIEW_PAGES = {
    "review-runs.png": "/",
    "review-run.png": "/runs/2026-11-29",
    "review-task.png": f"/runs/2026-11-29/tasks/{REVIEW_TASK}",
    "review-queue.png": "/queue",
}


def find_chromium(given: str | None, install: bool) -> str:
    for candidate in [given, "chromium", "chromium-browser", "google-chrome"]:
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    if install:
        subprocess.run(["apt-get", "install", "-y", "chromium"], check=True)
        if shutil.which("chromium"):
            return shutil.which("chromium")
    raise SystemExit("no Chromium found: `apt-get install -y chromium`, or pass --chromium PATH, or --install")


def screenshot(chromium: str, url: str, out: Path, profile: Path) -> None:
    """One page as a PNG, with a fresh empty profile and no network beyond loopback."""
    profile.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={WINDOW}",
         f"--virtual-time-budget={VIRTUAL_TIME_MS}", f"--screenshot={out}", url],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    if not out.exists() or out.stat().st_size == 0:
        raise SystemExit(f"{out}: Chromium wrote no screenshot of {url}")


def shrink(png: Path) -> None:
    """Re-encode as a palette PNG when Pillow is there and the file is over MAX_BYTES (UI pages have few colours)."""
    if png.stat().st_size <= MAX_BYTES:
        return
    try:
        from PIL import Image
    except ImportError:
        print(f"{png}: {png.stat().st_size} bytes (install Pillow to shrink it)")
        return
    Image.open(png).convert("RGB").quantize(colors=128).save(png, optimize=True)


def filtered(server: DagsterDev, run_ids: list[str]) -> bool:
    kept = all((server.data / "warehouse" / "kept" / f"{r}.parquet").exists() for r in run_ids)
    coverage = (server.data / "warehouse" / "coverage.parquet").exists()
    runs = server.runs()
    return kept and coverage and bool(runs) and all(r.status in ("SUCCESS", "FAILURE", "CANCELED") for r in runs)


def review_pages(chromium: str, data: Path, out: Path, work: Path) -> None:
    """The review app's pages over the filtered data root, served by `filter-pipeline review` on loopback."""
    import urllib.request

    from filter_pipeline_tests.servers import free_port

    port = free_port()
    command = [str(REPO / ".venv" / "bin" / "filter-pipeline"), "review", "--data", str(data), "--port", str(port)]
    app = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline or app.poll() is not None:
                    raise SystemExit(f"the review app did not answer at {url}: {app.stderr.read()[-1500:]}") from None
                time.sleep(0.5)
        for name, path in REVIEW_PAGES.items():
            target = out / name
            screenshot(chromium, url + path, target, work / f"profile-{name}")
            shrink(target)
            print(f"{target}  {target.stat().st_size // 1000} KB  {path}")
    finally:
        app.terminate()
        app.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--chromium", help="path of the Chromium binary (default: found on PATH)")
    parser.add_argument("--install", action="store_true", help="apt-get install chromium when none is found")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium, args.install)
    args.out.mkdir(parents=True, exist_ok=True)

    work = Path(tempfile.mkdtemp(prefix="filter-screenshots-"))
    try:
        data = work / "data"
        shutil.copytree(REPO / "data" / "runs", data / "runs")
        shutil.copy(REPO / "data" / "labels.jsonl", data / "labels.jsonl")
        new_runs = sorted(p.name for p in (data / "runs").iterdir() if not (p / "kept.jsonl").exists())
        with DagsterDev(work / "home", data) as server:
            deadline = time.time() + FILTER_SECONDS
            while not filtered(server, new_runs):
                if time.time() > deadline:
                    raise SystemExit(
                        f"the sensor did not filter {new_runs} within {FILTER_SECONDS} s:\n{server.log_tail(1500)}"
                    )
                time.sleep(3)
            server.dismiss_community_dialog()
            time.sleep(5)  # the asset health badges catch up on the last materializations
            last = new_runs[-1]
            pages = {
                "asset-graph.png": f"{server.url}/assets/kept?view=lineage&lineageScope=neighbors&lineageDepth=4",
                "kept-partitions.png": f"{server.url}/assets/kept?view=partitions&partition={last}",
                "filter-report.png": f"{server.url}/assets/filter_report?view=events&partition={last}",
            }
            # a first visit warms the webserver's caches (the workspace, the asset graph): it can take longer
            # than any budget on a busy machine and photograph a spinner, so it is thrown away
            for name, url in pages.items():
                screenshot(chromium, url, work / f"warm-{name}", work / f"profile-warm-{name}")
            for name, url in pages.items():
                target = args.out / name
                screenshot(chromium, url, target, work / f"profile-{name}")
                shrink(target)
                print(f"{target}  {target.stat().st_size // 1000} KB  {url.removeprefix(server.url)}")
        review_pages(chromium, data, args.out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
