"""A small HTTP proxy on 127.0.0.1 that forwards to a test store server and injects faults on a
fixed schedule: 503 SlowDown answers, connection resets before any answer, and response bodies
cut short by a reset. It is test equipment, in front of the real server, not a fake of it.

The schedule counts requests in arrival order, which parallel clients (ranged downloads in threads)
make vary from run to run. So that no interleaving can make a test fail, a request whose previous
attempt was faulted is let through: every request succeeds by its second attempt, within any
client's retry budget, however the counts fall. Clients that hang up on purpose (a deadline, a
cancelled transfer) are expected here: their resets end the handler quietly, never with a
traceback printed from a server thread.

A schedule can also hold requests: those its `hold` rule picks (by client address, method, path
and body) wait, whole, in the proxy until `released` is set, and are then sent on, as a request
that a cut link delayed would be. Every answer is recorded with the client's address."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vitforge.testing import QuietHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultSchedule:
    def __init__(self, slow_down_every: int, reset_every: int, cut_body_every: int, latency_s: float = 0.0,
                 flip_once: str | None = None, cut_only: tuple[str, ...] | None = None,
                 hold: Callable[[str, str, str, bytes], bool] | None = None):
        self.every = {"slow_down": slow_down_every, "reset": reset_every, "cut_body": cut_body_every}
        # the methods whose answers may be cut (None: all), for a server that cannot take a resent part
        self.cut_only = cut_only
        self.latency_s = latency_s  # added to every request: a slow link, so work can be caught mid-upload
        # the first GET of a path holding this gets one byte of its answer flipped: a bit error on the way
        self.flip_once = flip_once
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, faults included
        self.hold = hold  # (client address, method, path, body) -> whether to hold the request
        self.held: list[tuple[str, str, str]] = []  # (client address, method, path) of every request held
        self.released = threading.Event()
        # (client address, method, path, status) of every request sent on, in the order answered
        self.answers: list[tuple[str, str, str, int]] = []
        self.count = 0
        self.injected = {name: 0 for name in self.every}
        self.faulted: set[tuple] = set()  # the requests whose last attempt was faulted
        self.lock = threading.Lock()

    def flip(self, command: str, path: str) -> bool:
        with self.lock:
            hit = command == "GET" and self.flip_once is not None and self.flip_once in path
            if hit:
                self.flip_once = None
            return hit

    def next_fault(self, command: str, request: tuple) -> str | None:
        """The fault for this attempt of `request` (method, path and ranges), or None."""
        with self.lock:
            self.count += 1
            if request in self.faulted:
                self.faulted.discard(request)
                return None
            for name, every in self.every.items():
                if name == "cut_body" and self.cut_only is not None and command not in self.cut_only:
                    continue
                if every and self.count % every == 0:
                    self.injected[name] += 1
                    self.faulted.add(request)
                    return name
            return None


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def start_proxy(backend_port: int, schedule: FaultSchedule, listen: str = "127.0.0.1",
                backend_host: str = "127.0.0.1") -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raise RuntimeError("chunked request bodies are not supported by this proxy")
            body = self.rfile.read(length) if length else None
            schedule.requests.append((self.command, self.path))
            peer = self.client_address[0]
            if schedule.hold is not None and schedule.hold(peer, self.command, self.path, body or b""):
                schedule.held.append((peer, self.command, self.path))
                schedule.released.wait()
            if schedule.latency_s:
                time.sleep(schedule.latency_s)
            fault = schedule.next_fault(self.command, (self.command, self.path, self.headers.get("Range"),
                                                       self.headers.get("Content-Range")))
            if fault == "reset":
                self.close_connection = True
                _reset(self.connection)
                return
            if fault == "slow_down":
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                return
            upstream = http.client.HTTPConnection(backend_host, backend_port, timeout=60)
            upstream.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
            response = upstream.getresponse()
            data = response.read()
            upstream.close()
            schedule.answers.append((peer, self.command, self.path, response.status))
            if data and schedule.flip(self.command, self.path):
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            self.send_response_only(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else
                                                   response.getheader("Content-Length") or 0))
            self.end_headers()
            if self.command == "HEAD":
                return
            if fault == "cut_body" and len(data) > 64:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                _reset(self.connection)
                return
            self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    server = QuietHTTPServer((listen, 0), Handler)
    server.label = "fault proxy"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]
