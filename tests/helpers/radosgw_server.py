"""A second real S3 implementation for the tests: Ceph's radosgw on a throwaway one-node cluster.

SeaweedFS alone could hide what only it does; radosgw is the S3 of many on-premises stores and
implements conditional writes its own way (an OSD-side compare of the ETag attribute, and a
bare, unquoted If-Match only). The binaries come from Debian's packages (``apt-get install
radosgw ceph-mon ceph-osd``); tests that need them are skipped, with the reason, when missing.

The cluster is one monitor and one OSD on memstore (RAM, nothing to format), cephx off, every
file under one temporary directory and every command given ``-c`` our ceph.conf: nothing
system-wide is read or written. The monitor and radosgw listen on free ports picked here; the
OSD binds its own in Ceph's range (6800-7300), moving on past taken ones. Stopping sends
SIGTERM to radosgw, the OSD, then the monitor (the OSD waits for the monitor to hear it
leave), and SIGKILL to any that lingers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from process_harness import stop_gently
from seaweedfs_server import die_with_parent

BINARIES = ("monmaptool", "ceph-mon", "ceph", "ceph-osd", "radosgw-admin", "radosgw")
"""What the cluster needs on PATH (``ceph`` and ``monmaptool`` come with ceph-mon's dependencies)."""

INSTALL_HINT = "apt-get install radosgw ceph-mon ceph-osd"

START_TIMEOUT = 90.0
"""Seconds the whole cluster may take before S3 answers (it usually needs 1 to 2)."""

COMMAND_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0

RGW_NAME = "client.rgw.gm"


def find_ceph() -> tuple[dict[str, str], list[str]]:
    """The path of each binary found on PATH, and the names of those missing."""
    found = {name: shutil.which(name) for name in BINARIES}
    return {name: path for name, path in found.items() if path}, [n for n, p in found.items() if not p]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (all held until all are picked)."""
    held = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


def _config(directory: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    """ceph.conf of the cluster. Options, by why:

    - cephx off (no keyrings to make); radosgw asks for a secure monitor connection by default,
      which "none" authentication cannot give: ``ms_mon_client_mode = crc`` for it.
    - one OSD: pools of size 1, placement across OSDs not hosts, small pools; no autoscaler
      (that is ceph-mgr's, not started).
    - speed: the monitor commits each change at once (it batches them for a second by
      default: radosgw's first start makes ~20, the first bucket a few), and a client whose
      request waits for the OSD to come up looks again after 0.1 s, not 5.
    - logs, pids and data under ``directory``; no admin sockets; the monitor's cluster log
      (otherwise /var/log/ceph/ceph.log) off.
    """
    return f"""[global]
fsid = {fsid}
mon_host = v2:127.0.0.1:{mon_port}
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_ipv6 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = {directory}/run
pid_file = {directory}/run/$name.pid
admin_socket =
log_file = {directory}/log/$name.log
crash_dir = {directory}/crash
mon_cluster_log_to_file = false
mon_data = {directory}/mon/$id
osd_data = {directory}/osd/$id
keyring = {directory}/keyring
osd_objectstore = memstore
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 1000
osd_crush_chooseleaf_type = 0
paxos_propose_interval = 0.01
paxos_min_wait = 0.001
objecter_tick_interval = 0.1

[{RGW_NAME}]
ms_mon_client_mode = crc
rgw_frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw_data = {directory}/rgw
rgw_enable_gc_threads = false
rgw_enable_lc_threads = false
rgw_enable_quota_threads = false
"""


def _ceph_env() -> dict[str, str]:
    """Our environment without Ceph's own variables: only ``-c`` says which cluster."""
    return {name: value for name, value in os.environ.items() if name not in ("CEPH_ARGS", "CEPH_CONF")}


class RadosgwServer:
    """A one-node Ceph cluster with radosgw serving S3 on a free port of 127.0.0.1."""

    def __init__(self, binaries: dict[str, str], directory: Path) -> None:
        self.binaries = binaries
        self.directory = Path(directory)
        self.conf = self.directory / "ceph.conf"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}  # started order: mon, osd, rgw
        self.endpoint = ""
        self.timings: dict[str, float] = {}  # seconds each phase of start() took

    # -- start ---------------------------------------------------------------------------
    def start(self, access_key: str, secret_key: str) -> str:
        """Start the cluster and return radosgw's S3 endpoint once S3 answers with the user
        ``access_key`` / ``secret_key``; RuntimeError (everything stopped) otherwise."""
        began = time.monotonic()
        try:
            self._start(access_key, secret_key, began + START_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - began
        return self.endpoint

    def _start(self, access_key: str, secret_key: str, deadline: float) -> None:
        mon_port, rgw_port = _free_ports(2)
        for name in ("run", "log", "mon", "osd/0", "rgw", "crash"):
            (self.directory / name).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        self.conf.write_text(_config(self.directory, fsid, mon_port, rgw_port))

        with self._phase("mon"):
            monmap = str(self.directory / "monmap")
            self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", monmap)
            self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap)
            self._spawn("mon", "ceph-mon", "-f", "-i", "a")
            self._wait_for_port(mon_port, "mon", deadline)
        with self._phase("osd"):
            osd_uuid = str(uuid.uuid4())
            osd_id = self._run("ceph", "osd", "new", osd_uuid).strip()
            self._run("ceph-osd", "--mkfs", "-i", osd_id, "--osd-uuid", osd_uuid)
            self._spawn("osd", "ceph-osd", "-f", "-i", osd_id)
        with self._phase("user"):  # waits for the OSD: radosgw-admin creates rgw's first pools
            self._run(
                "radosgw-admin", "user", "create", "--uid=gm-tests", "--display-name=gradientmail tests",
                f"--access-key={access_key}", f"--secret-key={secret_key}",
            )  # fmt: skip
        with self._phase("rgw"):
            self._spawn("rgw", "radosgw", "-f", "-n", RGW_NAME)
            self.endpoint = f"http://127.0.0.1:{rgw_port}"
            self._wait_until_s3_answers(access_key, secret_key, deadline)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        yield
        self.timings[name] = time.monotonic() - began

    def _run(self, binary: str, *args: str) -> str:
        """Run a Ceph command on our cluster; its stdout, or RuntimeError with its output."""
        command = [self.binaries[binary], "-c", str(self.conf), *args]
        try:
            done = subprocess.run(
                command, capture_output=True, stdin=subprocess.DEVNULL, env=_ceph_env(), timeout=COMMAND_TIMEOUT
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{' '.join(command)} took over {COMMAND_TIMEOUT:.0f} s\n{self.log_tail()}") from exc
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited with {done.returncode}:\n"
                f"{done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}\n{self.log_tail()}"
            )
        return done.stdout.decode()

    def _spawn(self, name: str, binary: str, *args: str) -> None:
        with open(self.directory / "log" / f"{name}.out", "wb") as log:
            self.processes[name] = subprocess.Popen(
                [self.binaries[binary], "-c", str(self.conf), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_ceph_env(),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"ceph {name} exited with {process.returncode} while starting:\n{self.log_tail()}")

    def _wait_for_port(self, port: int, name: str, deadline: float) -> None:
        """Poll until the port accepts: a client that connects earlier backs off for seconds."""
        while True:
            self._check_alive()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ceph {name} did not listen on {port} in time:\n{self.log_tail()}")
            time.sleep(0.05)  # polling for readiness, not waiting for an outcome

    def _wait_until_s3_answers(self, access_key: str, secret_key: str, deadline: float) -> None:
        """Poll with a signed ListBuckets until radosgw has loaded and answers it."""
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
        while True:
            self._check_alive()
            try:
                client.list_buckets()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"radosgw at {self.endpoint} did not accept requests within {START_TIMEOUT:.0f} s "
                    f"({last}):\n{self.log_tail()}"
                )
            time.sleep(0.1)  # polling for readiness, not waiting for an outcome

    # -- report, stop --------------------------------------------------------------------
    def rss_bytes(self) -> int | None:
        """Resident memory of the three daemons together (Linux), for the session's report."""
        total = 0
        for process in self.processes.values():
            try:
                for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except (OSError, ValueError, IndexError):
                pass
        return total or None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of each daemon's log, for a failure's message."""
        tails = []
        for path in sorted((self.directory / "log").glob("*.log")):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            tails.append(f"--- {path.name}\n" + "\n".join(line for line in text if line.strip()))
        return "\n".join(tails) or "(no log)"

    def stop(self) -> None:
        """SIGTERM radosgw, the OSD, then the monitor, SIGKILL what lingers; drop the data
        (the monitor's store; the OSD's is in RAM) and keep the logs."""
        for name in ("rgw", "osd", "mon"):
            stop_gently(self.processes.pop(name, None), signal.SIGTERM, STOP_TIMEOUT)
        for name in ("mon", "osd", "rgw"):
            shutil.rmtree(self.directory / name, ignore_errors=True)
