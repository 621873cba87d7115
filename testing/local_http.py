"""A static HTTP file server on 127.0.0.1 that answers byte ranges, for the tests and the benchmarks:
what a CDN or a plain web server in front of a dataset looks like to the loader and the sharder
(webdataset's own habit). Python's http.server lists folders as HTML (which fsspec's HTTP
filesystem reads as a listing) but ignores `Range`; this one answers `Range: bytes=a-b` with 206,
sends an ETag (size and modification time) and Last-Modified, and logs every request as one JSON
line (method, path, range, status), so a test can count what a reader fetched.

Runs as its own process (`python -m vitforge.testing.local_http ROOT PORT LOG`) through managed.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import TextIO

from vitforge.core import free_port

from .managed import start_process, stop_process, wait_until_ready

RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class LocalHTTP:
    root: str
    log_dir: str
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.log_dir, "http-server.log")

    @property
    def requests_path(self) -> str:
        return os.path.join(self.log_dir, "http-requests.jsonl")

    def requests(self) -> list[dict]:
        """Every request answered so far: {"method", "path", "range", "status"}, in answer order."""
        if not os.path.exists(self.requests_path):
            return []
        with open(self.requests_path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def start(self, timeout: float = 30) -> None:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "vitforge.testing.local_http", self.root, str(self.port), self.requests_path]
        self.process = start_process(cmd, self.log_path)

        def answers() -> bool:
            with urllib.request.urlopen(f"{self.url}/", timeout=2) as answer:
                return answer.status == 200

        wait_until_ready(self.process, answers, f"HTTP file server at {self.url}", self.log_path, timeout)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


def start_local_http(root: str, log_dir: str) -> LocalHTTP:
    """Serve the folder `root` at http://127.0.0.1:PORT (a free port); stop() ends it."""
    os.makedirs(log_dir, exist_ok=True)
    server = LocalHTTP(root, log_dir)
    server.start()
    return server


class RangeHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log_file: TextIO | None = None  # set by main: the JSON-lines request log
    log_lock = threading.Lock()
    file_stat: os.stat_result | None = None  # of the file this request answers with, for its ETag

    def log_message(self, *args) -> None:
        pass

    def log_request(self, code="-", size="-") -> None:
        status = code.value if isinstance(code, HTTPStatus) else code
        line = json.dumps(
            {
                "method": self.command,
                "path": self.path,
                "range": self.headers.get("Range"),
                "status": int(status) if str(status).isdigit() else status,
            }
        )
        with self.log_lock:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def end_headers(self) -> None:
        self.send_header("Accept-Ranges", "bytes")
        if self.file_stat is not None:
            self.send_header("ETag", f'"{self.file_stat.st_size:x}-{self.file_stat.st_mtime_ns:x}"')
        super().end_headers()

    def send_head(self):
        path = self.translate_path(self.path)
        self.file_stat = os.stat(path) if os.path.isfile(path) else None
        wanted = RANGE.match(self.headers.get("Range", "").strip())
        if self.file_stat is None or not wanted:
            return super().send_head()  # a folder's HTML listing, a whole file, or 404
        size = self.file_stat.st_size
        start = int(wanted.group(1))
        end = min(int(wanted.group(2)) if wanted.group(2) else size - 1, size - 1)
        if start >= size or end < start:
            self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f = open(path, "rb")  # noqa: SIM115 - the server's copyfile() sends the window, then closes it
        self.send_response(HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Last-Modified", self.date_time_string(int(self.file_stat.st_mtime)))
        self.end_headers()
        f.seek(start)
        return _Window(f, end - start + 1)

    def copyfile(self, source, outputfile) -> None:
        try:
            super().copyfile(source, outputfile)
        except ConnectionError:  # a client that hung up (a cancelled read): expected, not an error
            self.close_connection = True


class _Window:
    """`length` bytes of an open file from its position, read like a file by copyfile."""

    def __init__(self, f, length: int):
        self.f, self.left = f, length

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.f.close()


class QuietHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server whose clients may hang up at any time (a deadline, a cancelled read):
    their resets end the handler silently; anything else is one line on stderr, never a traceback
    printed from a server thread (on Python 3.11 one formatted while pytest formats a failure can
    take the whole run down: CPython gh-106905)."""

    daemon_threads = True
    label = "http file server"

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):
            sys.stderr.write(f"{self.label}: {type(error).__name__}: {error}\n")


def main(argv: list[str]) -> None:
    root, port, log = argv
    RangeHandler.log_file = open(log, "a")  # noqa: SIM115 - written until the server process ends

    def handler(*args, **kwargs):
        return RangeHandler(*args, directory=root, **kwargs)

    QuietHTTPServer(("127.0.0.1", int(port)), handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
