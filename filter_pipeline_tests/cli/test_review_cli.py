"""`filter-pipeline review` as a user starts it: a process serving the app on loopback, and its one-line errors."""

import os
import socket
import subprocess
import time
import urllib.request

import pytest

from filter_pipeline_tests.conftest import CLI, REPO
from filter_pipeline_tests.review.conftest import filtered_sample  # noqa: F401 (the session fixture)
from filter_pipeline_tests.servers import free_port, stop_process_group

pytestmark = pytest.mark.slow


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"))],
)
def test_review_serves_the_data_root_on_loopback_at_the_address_it_prints(filtered_sample, host):  # noqa: F811
    port = free_port()
    env = {**os.environ, "FILTER_PIPELINE_DATA": str(filtered_sample)}
    proc = subprocess.Popen([*CLI, "review", "--host", host, "--port", str(port)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        first = proc.stdout.readline()
        url = {"127.0.0.1": f"http://127.0.0.1:{port}/", "::1": f"http://[::1]:{port}/"}[host]
        assert first.startswith(f"review app for {filtered_sample}: {url} "), first
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}api/runs", timeout=5) as response:
                    assert b'"2026-11-29"' in response.read()
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the review app did not answer"
                time.sleep(0.2)
    finally:
        stop_process_group(proc, grace_seconds=10)


def test_review_refuses_a_missing_data_root_and_a_bad_port_in_one_line(tmp_path, filtered_sample):  # noqa: F811
    for args in [("--data", str(tmp_path / "missing")), ("--data", str(filtered_sample), "--port", "70000")]:
        done = subprocess.run([*CLI, "review", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_review_on_a_port_in_use_says_so_in_one_line_and_exits(filtered_sample):  # noqa: F811
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([*CLI, "review", "--data", str(filtered_sample), "--port", str(port)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith(f"filter-pipeline: cannot listen on 127.0.0.1:{port} (Address already in use)")
    assert len(done.stderr.strip().splitlines()) == 1


def test_review_on_an_address_it_cannot_have_says_why_without_blaming_the_port(filtered_sample):  # noqa: F811
    for host, said in [("nosuchhost.invalid", "--host nosuchhost.invalid: no such address"),
                       ("192.0.2.1", "cannot listen on 192.0.2.1:")]:  # fmt: skip
        done = subprocess.run([*CLI, "review", "--data", str(filtered_sample), "--host", host, "--port", "18999"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and done.stderr.startswith(f"filter-pipeline: {said}"), done.stderr
        assert "--port" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_review_on_every_ipv6_address_answers_ipv4_too(filtered_sample):  # noqa: F811
    if not socket.has_dualstack_ipv6():
        pytest.skip("this system cannot listen on IPv6 and IPv4 with one socket")
    from filter_pipeline.cli.review import _listen

    with _listen("::", 0) as listening:
        port = listening.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
