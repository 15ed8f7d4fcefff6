"""A real HTTP proxy in front of an S3 endpoint (moto's server) that breaks connections on cue.

Faults happen on the wire, where a real network breaks them, so the whole client stack under
test (urllib3, botocore, the mailbox) meets them as it would in production. Each connection
carries one request (the proxy answers ``Connection: close``), so the test's ``rule`` decides
the fate of every request, including botocore's own retries:

- ``PASS``: forward the request and relay the answer whole.
- ``TRUNCATE``: relay the status line and headers (the full ``Content-Length``) and half the
  body, then close: the client sees an incomplete body (IncompleteRead).
- ``BREAK``: like ``TRUNCATE``, but reset the connection (RST) after half the body.
- ``RESET``: read the request, then reset the connection (RST) without any answer: the
  request never reaches the store.
- ``LOST``: forward the request (it takes effect), then reset the connection without an
  answer: the client cannot tell whether it landed.
- ``DROP``: reset the connection as soon as the request's headers arrived, before its body.
- ``STALL``: relay the headers and half the body, then wait until the client gives up
  (its read timeout) and closes; nothing is timed here.
- ``PRECONDITION``: answer ``412 PreconditionFailed`` without forwarding, as a store whose
  conditional check refused the request (Ceph's radosgw does so for a quoted ``If-Match``).
- ``DENIED``: answer ``403 AccessDenied`` without forwarding, as stores do for a bucket the
  caller may not see (AWS, when it may not list it; some S3-compatible stores for a missing one).

The rule is called with the request (method, path, query) and the 1-based number of that
request; it runs on the proxy's threads, so it should only count and decide.
"""

from __future__ import annotations

import http.client
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

PASS, TRUNCATE, BREAK, RESET, LOST, DROP, STALL, PRECONDITION, DENIED = (
    "pass",
    "truncate",
    "break",
    "reset",
    "lost",
    "drop",
    "stall",
    "precondition",
    "denied",
)
_ACTIONS = frozenset({PASS, TRUNCATE, BREAK, RESET, LOST, DROP, STALL, PRECONDITION, DENIED})
_ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)
_PRECONDITION_FAILED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code>'
    b"<Message>At least one of the pre-conditions you specified did not hold</Message></Error>"
)
_MAX_HEADER = 64 * 1024
_NOT_FORWARDED = frozenset({"connection", "transfer-encoding", "content-length", "expect"})


@dataclass(frozen=True)
class Request:
    """What the proxy saw of one request."""

    method: str
    path: str  # without the query string
    query: str
    number: int  # 1-based, over the proxy's lifetime
    headers: tuple[tuple[str, str], ...] = ()

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)


Rule = Callable[[Request], str]


class FaultProxy:
    """``with FaultProxy(upstream) as proxy:`` → point ``endpoint_url`` at ``proxy.url``.

    ``proxy.rule`` may be replaced at any time; ``proxy.faults`` counts the faults injected.
    """

    def __init__(self, upstream: str, rule: Rule | None = None) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rule: Rule = rule or (lambda request: PASS)
        self.faults = 0
        self.requests = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy.handle_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # -- one connection, one request ---------------------------------------------------------
    def _decide(self, request: Request) -> str:
        with self._lock:
            action = self.rule(request)
            if action not in _ACTIONS:
                raise ValueError(f"unknown proxy action {action!r}")
            if action != PASS:
                self.faults += 1
            return action

    def handle_connection(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        try:
            with self._lock:
                self.requests += 1
                number = self.requests
            head = _read_head(reader)
            if head is None:
                return
            request_line, headers = head
            method, target, _ = request_line.split(" ", 2)
            path, _, query = target.partition("?")
            action = self._decide(Request(method, path, query, number, tuple(headers)))
            if action == DROP:
                _reset(conn)
                return
            if any(k.lower() == "expect" and "100" in v for k, v in headers):
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # else botocore waits 1 s
            body = _read_body(reader, headers)
            if action == RESET:
                _reset(conn)
                return
            if action in (PRECONDITION, DENIED):
                status, error = (
                    ("412 Precondition Failed", _PRECONDITION_FAILED)
                    if action == PRECONDITION
                    else ("403 Forbidden", _ACCESS_DENIED)
                )
                head = f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
                head += f"Content-Length: {len(error)}\r\nConnection: close\r\n\r\n"
                conn.sendall(head.encode("latin-1") + error)
                return
            status, reason, answer_headers, answer = self._forward(method, target, headers, body)
            if action == LOST:
                _reset(conn)
                return
            length = next((int(v) for k, v in answer_headers if k.lower() == "content-length"), len(answer))
            lines = [f"HTTP/1.1 {status} {reason}"]
            lines += [
                f"{k}: {v}"
                for k, v in answer_headers
                if k.lower() not in ("connection", "transfer-encoding", "content-length")
            ]
            lines += [f"Content-Length: {length}", "Connection: close", "", ""]
            sent = answer if action == PASS else answer[: len(answer) // 2]
            conn.sendall("\r\n".join(lines).encode("latin-1") + sent)
            if action == STALL:
                while conn.recv(65536):  # until the client times out and closes
                    pass
            elif action == TRUNCATE:
                conn.shutdown(socket.SHUT_WR)
            elif action == BREAK:
                _reset(conn)
        except OSError:
            pass  # the client went away; nothing to relay
        finally:
            reader.close()
            conn.close()

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _NOT_FORWARDED:
                    upstream.putheader(name, value)
            upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body)
            response = upstream.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            upstream.close()


def _read_head(reader) -> tuple[str, list[tuple[str, str]]] | None:
    request_line = reader.readline(_MAX_HEADER).decode("latin-1").rstrip("\r\n")
    if not request_line:
        return None
    headers = []
    while True:
        line = reader.readline(_MAX_HEADER).decode("latin-1").rstrip("\r\n")
        if not line:
            return request_line, headers
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))


def _read_body(reader, headers: list[tuple[str, str]]) -> bytes:
    fields = {name.lower(): value for name, value in headers}
    if "chunked" in fields.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size = int(reader.readline(_MAX_HEADER).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while reader.readline(_MAX_HEADER).strip():  # trailers
                    pass
                return b"".join(chunks)
            chunks.append(reader.read(size))
            reader.readline(_MAX_HEADER)
    length = int(fields.get("content-length", "0") or 0)
    return reader.read(length) if length else b""


def _reset(conn: socket.socket) -> None:
    """Close with RST instead of FIN, as a crashed server or a dropping middlebox does."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
