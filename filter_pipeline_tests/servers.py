"""Real servers on loopback for the deployment tests: moto's S3-compatible server and a throwaway
PostgreSQL cluster. Each raises ServerUnavailable with the reason when it cannot start, so the fixture
skips with that reason instead of failing or passing silently."""

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "filter-test",
    "AWS_SECRET_ACCESS_KEY": "filter-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class ServerUnavailable(RuntimeError):
    """A server could not start here; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, grace_seconds: float) -> None:
    """SIGTERM a process started with start_new_session and everything it started; SIGKILL after the grace."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _wait(ready, what: str, proc: subprocess.Popen | None, log: Path, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"{what} exited with {proc.returncode}: {log.read_text()[-1500:]}")
        if ready():
            return
        time.sleep(0.2)
    raise ServerUnavailable(f"{what} did not answer within {seconds:.0f} s: {log.read_text()[-1500:]}")


class MotoS3:
    """moto's standalone S3 server (`moto_server`), as its own process."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "moto.log"
        binary = Path(sys.executable).parent / "moto_server"
        if not binary.exists():
            raise ServerUnavailable(f"{binary} is missing: install the test extra (pip install -e '.[test]')")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT
        )
        _wait(self._answers, "moto_server", self.proc, self.log_path)

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
            return True
        except OSError:
            return False

    @property
    def env(self) -> dict:
        """The standard AWS variables a user sets for an S3-compatible store."""
        return {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.endpoint,
            use_listings_cache=False,
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def postgres_bindir() -> Path | None:
    """Where the PostgreSQL server binaries are: PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PostgresCluster:
    """A throwaway cluster in a temp dir on a free loopback port, password-protected like a real one.

    PostgreSQL refuses to run as root; as root, the cluster runs as the `postgres` user that Debian's
    package creates.
    """

    USER, PASSWORD, DB = "dagster", "filter-test-pw", "dagster"

    def __init__(self):
        bindir = postgres_bindir()
        if bindir is None:
            raise ServerUnavailable(
                "no PostgreSQL server binaries (initdb): `apt-get install postgresql` (.ci/run does)"
            )
        self.bindir, self.port = bindir, free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="filter-pg-"))
        self.run_as: list[str] = []
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise ServerUnavailable("running as root and there is no `postgres` user to run the server") from exc
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            self.run_as = ["runuser", "-u", "postgres", "--"]
        self.log_path = self.dir / "server.log"
        pwfile = self.dir / "pwfile"
        pwfile.write_text(self.PASSWORD)
        if self.run_as:
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        data = self.dir / "data"
        self._run("initdb", "-D", str(data), "-U", self.USER, f"--pwfile={pwfile}", "-A", "scram-sha-256", "-E", "UTF8")
        self._run(
            "pg_ctl", "-D", str(data), "-l", str(self.log_path), "-w", "-t", "60",
            "-o", f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.dir}", "start",
        )  # fmt: skip
        self.data = data

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run([*self.run_as, str(self.bindir / tool), *args], capture_output=True, text=True)
        if result.returncode != 0:
            log = self.log_path.read_text()[-1500:] if self.log_path.exists() else ""
            raise ServerUnavailable(f"{tool} failed ({result.returncode}): {result.stderr[-1500:]}{log}")

    @property
    def env(self) -> dict:
        """What deploy/dagster-postgres.yaml reads."""
        return {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USERNAME": self.USER,
            "DAGSTER_PG_PASSWORD": self.PASSWORD,
            "DAGSTER_PG_DB": self.DB,
        }

    def create_database(self, name: str) -> None:
        import psycopg2

        connection = psycopg2.connect(
            host="127.0.0.1", port=self.port, user=self.USER, password=self.PASSWORD, dbname="postgres"
        )
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        connection.close()

    def stop(self) -> None:
        subprocess.run([*self.run_as, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True)  # fmt: skip
        shutil.rmtree(self.dir, ignore_errors=True)
