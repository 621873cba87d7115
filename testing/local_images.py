"""An image web server on 127.0.0.1 that misbehaves on purpose, for the URL-list tests and url_bench.

Routes (each request is logged as {"path", "status", "t"} when it arrives, `t` from time.monotonic(),
its status once answered: None for one its client gave up on):
    /img/NAME                good image NAME (from the dict given to start())
    /slow/NAME               NAME after `slow_s` seconds (a run that lasts long enough to be killed)
    /missing/NAME            404
    /flaky/NAME              500 the first time per path, then NAME
    /throttled/NAME          429 with Retry-After: 1 the first time per path, then NAME
    /stalled/NAME            headers only after `stall_s` seconds
    /trickle/NAME            NAME in 20 pieces `trickle_s` / 20 apart (each read is quick, the whole is slow)
    /cut/NAME                Content-Length 2x what is sent, then the connection closes
    /redirect/K/NAME         K redirects, then NAME
    /loop/a, /loop/b         redirect to each other
    /to/URL-QUOTED           a redirect to any URL (to a refused address, say)
    /as-html/NAME            NAME served as text/html
    /html-as-jpeg/x.jpg      an HTML page served as image/jpeg
    /big/NAME                NAME padded past any small --max-body, with a Content-Length
    /big-chunked/NAME        the same without a Content-Length (chunked)
    /noai/NAME               NAME with X-Robots-Tag: noai
    /otherbot/NAME           NAME with X-Robots-Tag: otherbot: noai (not addressed to vitforge)
    /private/NAME            NAME, but robots.txt disallows /private/ for vitforge
    /robots.txt              that robots.txt (with `robots_slowly`: after 100 KiB of comments, in
                             pieces 20 ms apart, so that no single read returns the whole of it)
Runs an aiohttp application on an event loop thread of its own, in the calling process.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from aiohttp import web

ROBOTS_TXT = "User-agent: vitforge\nDisallow: /private/\n\nUser-agent: *\nDisallow: /nobody/\n"


@dataclass
class ImageServer:
    images: dict[str, bytes]
    slow_s: float = 0.2
    stall_s: float = 5.0
    trickle_s: float = 5.0
    robots_slowly: bool = False
    log: list[dict] = field(default_factory=list)
    port: int = 0
    _seen: set = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self, prefix: str = "") -> list[str]:
        return [entry["path"] for entry in list(self.log) if entry["path"].startswith(prefix)]

    def start(self) -> ImageServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="image-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result()
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _first_time(self, path: str) -> bool:
        fresh = path not in self._seen
        self._seen.add(path)
        return fresh

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        entry = {"path": request.path, "status": None, "t": time.monotonic()}  # logged as it arrives
        self.log.append(entry)
        response = await self._route(request)
        entry["status"] = response.status
        return response

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        route, _, rest = path.lstrip("/").partition("/")
        image = self.images.get(rest.rsplit("/", 1)[-1])
        jpeg = {"Content-Type": "image/jpeg"}
        if path == "/robots.txt" and self.robots_slowly:
            return await self._robots_slowly(request)
        if path == "/robots.txt":
            return web.Response(text=ROBOTS_TXT)
        if route == "loop":
            return web.Response(status=302, headers={"Location": "/loop/b" if rest == "a" else "/loop/a"})
        if route == "to":
            return web.Response(status=302, headers={"Location": urllib.parse.unquote(rest)})
        if route == "redirect":
            hops, _, name = rest.partition("/")
            target = f"/redirect/{int(hops) - 1}/{name}" if int(hops) > 1 else f"/img/{name}"
            return web.Response(status=301, headers={"Location": target})
        if route == "html-as-jpeg":
            return web.Response(body=b"<html><body>not an image</body></html>", headers=jpeg)
        if image is None or route == "missing":
            return web.Response(status=404, text="not found")
        if route == "flaky" and self._first_time(path):
            return web.Response(status=500, text="try again")
        if route == "throttled" and self._first_time(path):
            return web.Response(status=429, headers={"Retry-After": "1"})
        if route == "stalled":
            await asyncio.sleep(self.stall_s)
        if route == "slow":
            await asyncio.sleep(self.slow_s)
        if route in ("trickle", "cut", "big-chunked"):
            return await self._stream(request, route, image)
        headers = {
            "as-html": {"Content-Type": "text/html"},
            "noai": {**jpeg, "X-Robots-Tag": "noai"},
            "otherbot": {**jpeg, "X-Robots-Tag": "otherbot: noai"},
        }.get(route, jpeg)
        body = image + bytes(1 << 20) if route == "big" else image
        return web.Response(body=body, headers=headers)

    async def _robots_slowly(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        comments = ("# " + "x" * 1021 + "\n").encode() * 100
        for start in range(0, len(comments), 10 * 1024):
            await response.write(comments[start : start + 10 * 1024])
            await asyncio.sleep(0.02)
        await response.write(ROBOTS_TXT.encode())
        await response.write_eof()
        return response

    async def _stream(self, request: web.Request, route: str, image: bytes) -> web.StreamResponse:
        try:
            return await self._send_slowly(request, route, image)
        except ConnectionResetError:  # the client gave up (its deadline): expected, and not worth a traceback
            raise asyncio.CancelledError from None

    async def _send_slowly(self, request: web.Request, route: str, image: bytes) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/jpeg"})
        if route == "cut":
            response.content_length = 2 * len(image)
        await response.prepare(request)
        if route == "cut":
            await response.write(image)
            request.transport.close()  # fewer bytes than promised, then the connection is gone
            return response
        if route == "big-chunked":
            for _ in range(20):
                await response.write(bytes(1 << 16))
            await response.write_eof()
            return response
        piece = -(-len(image) // 20)
        for start in range(0, len(image), piece):
            await response.write(image[start : start + piece])
            await asyncio.sleep(self.trickle_s / 20)
        await response.write_eof()
        return response


def start_image_server(images: dict[str, bytes], **timing) -> ImageServer:
    """Serve `images` (name -> bytes) at http://127.0.0.1:PORT (a free port); stop() ends it."""
    return ImageServer(images, **timing).start()
