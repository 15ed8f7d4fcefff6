"""Moto's S3 server behind a ``LatencyProxy``, in a process of its own: a distant S3 for benchmarks.

The store runs outside the measured process so that its Python threads do not take the training
loop's GIL, as a real endpoint's would not; it still shares this machine's cores, so the table
reports the CPU seconds it used per request. Credentials are dummies set in the environment
(moto accepts any); nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import time

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "benchmark",
    "AWS_SECRET_ACCESS_KEY": "benchmark",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Set in this process's environment by ``S3Endpoint`` (moto accepts any credentials)."""


def _serve(latency: float, channel: multiprocessing.connection.Connection) -> None:
    """The child: start moto and the proxy, send the proxy's URL, answer ``usage`` until ``stop``."""
    from moto.server import ThreadedMotoServer

    from benchmarks.latency_proxy import LatencyProxy

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        with LatencyProxy(f"http://{host}:{port}", latency) as proxy:
            channel.send((proxy.url, f"http://{host}:{port}"))
            while (message := channel.recv()) != "stop":
                assert message == "usage", message
                channel.send((time.process_time(), proxy.requests))
    finally:
        server.stop()


class S3Endpoint:
    """``with S3Endpoint(0.020) as endpoint:`` → ``endpoint.url`` (through the proxy), ``endpoint.bucket``.

    ``usage()`` returns (CPU seconds the store's process has used, requests it has forwarded).
    """

    def __init__(self, latency: float, bucket: str = "gm-bench") -> None:
        self.latency = latency
        self.bucket = bucket
        self.url = self.direct_url = ""
        self._channel: multiprocessing.connection.Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None

    def __enter__(self) -> S3Endpoint:
        os.environ.update(DUMMY_CREDENTIALS)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        context = multiprocessing.get_context("spawn")  # the parent may have imported torch
        self._channel, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(self.latency, child), daemon=True)
        self._process.start()
        child.close()
        try:
            if not self._channel.poll(60):
                raise RuntimeError("moto's server did not start within 60 s")
            self.url, self.direct_url = self._channel.recv()
        except (EOFError, RuntimeError) as exc:
            self.__exit__()
            raise RuntimeError(
                f"the S3 endpoint's process failed to start (exit code {self._process.exitcode})"
            ) from exc
        import boto3

        boto3.client("s3", endpoint_url=self.direct_url, region_name="us-east-1").create_bucket(Bucket=self.bucket)
        return self

    def usage(self) -> tuple[float, int]:
        assert self._channel is not None, "use S3Endpoint in a with block"
        self._channel.send("usage")
        return self._channel.recv()

    def __exit__(self, *exc: object) -> None:
        if self._channel is not None:
            try:
                self._channel.send("stop")
            except OSError:
                pass
            self._channel.close()
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
