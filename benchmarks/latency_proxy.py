"""An HTTP proxy that holds every request for a fixed time before forwarding it: a distant store.

Benchmarks put it in front of moto's S3 server on 127.0.0.1, so that the whole client stack
(botocore, urllib3, ``S3Mailbox``) pays the round trip of a remote endpoint on every request,
retries and listing pages included, as it would against a real S3 region. Connections stay open
on both sides (HTTP/1.1 keep-alive), like botocore's pool against S3: the delay is the
request's, not a connection set-up's.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
from urllib.parse import urlsplit

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "expect"})


class LatencyProxy:
    """``with LatencyProxy(upstream, 0.020) as proxy:`` → point ``endpoint_url`` at ``proxy.url``.

    ``requests`` counts the requests forwarded (read it once traffic is quiet).
    """

    def __init__(self, upstream: str, latency: float) -> None:
        if latency < 0:
            raise ValueError(f"latency must be >= 0, not {latency}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.latency = latency
        self.requests = 0
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="latency-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def counted(self) -> None:
        with self._lock:
            self.requests += 1


def _handler(proxy: LatencyProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive; also answers ``Expect: 100-continue``
        upstream: http.client.HTTPConnection | None = None

        def setup(self) -> None:
            super().setup()
            # Headers and body leave in separate writes: without this, Nagle's algorithm holds
            # the body until the client's delayed ACK (40 ms on Linux).
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
            pass

        def forward(self) -> None:
            body = _read_body(self)
            time.sleep(proxy.latency)  # the one-way trips of a distant endpoint, both ways
            proxy.counted()
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                self.upstream.connect()
                self.upstream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = self.upstream
            connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    connection.putheader(name, value)
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            answer = response.read()
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(answer)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        def finish(self) -> None:
            super().finish()
            if self.upstream is not None:
                self.upstream.close()

    return Handler


def _read_body(handler: http.server.BaseHTTPRequestHandler) -> bytes:
    if "chunked" in handler.headers.get("Transfer-Encoding", "").lower():
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline().strip():  # trailers
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length", "0") or 0)
    return handler.rfile.read(length) if length else b""
