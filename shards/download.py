"""Downloading a URL list's images: aiohttp on an event loop of its own, results in input order.

What one request does, hop by hop (the first URL and each redirect):
- the URL's address is checked against the request-forgery guard (url_guard) after DNS;
- the origin's robots.txt is consulted (fetched once per origin, optouts);
- the origin's turn is waited for (host_turns: a connection slot and the rate limit), then GET
  with connect and first-byte timeouts (the address checked again as the socket is made);
- a redirect is followed up to `max_redirects` hops (a URL seen twice is a loop);
- the body is read up to `max_bytes` (a Content-Length above it is refused unread), and an
  `X-Robots-Tag` that opts out refuses it;
all inside one overall deadline, which pauses while the request waits for its origin's turn or
its origin's robots.txt (fetched once, under a deadline of its own): which rows time out depends on
the servers, not on the concurrency. Connection errors, timeouts, a cut body, 408, 429 and 5xx are retried with
exponential backoff, honouring `Retry-After` up to `retry_after_cap`; other 4xx never are.
Whatever happens becomes a `Fetched` with a stable reason code, never an exception.

`fetch_ordered` yields results in the order of its input, whatever order the downloads finish
in: that is what makes the shards' bytes independent of concurrency and timing.

Per process: at most `window` Fetched in flight, each holding at most `max_bytes` of body; the
robots.txt cache (bounded in bytes, optouts); per-origin turns for the requests in flight only
(host_turns); aiohttp's DNS cache, at most DNS_CACHE_HOSTS names (a few hundred bytes each).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import functools
import math
import random
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

import aiohttp
from yarl import URL

from vitforge.core import UsageError

from .host_turns import HostTurns
from .optouts import OPT_OUTS, ROBOTS_MAX_BYTES, RobotsCache, x_robots_refusal
from .url_guard import ForbiddenAddress, GuardedResolver, Network, check_literal, guarded_socket

if TYPE_CHECKING:
    from multidict import CIMultiDictProxy  # aiohttp's headers

USER_AGENT = "vitforge/1 (+https://github.com/vitforge/vitforge; image dataset builder; honours robots.txt and noai)"
USER_AGENT_TOKEN = "vitforge"  # what robots.txt groups and X-Robots-Tag prefixes address
REDIRECTS = frozenset({301, 302, 303, 307, 308})
DNS_CACHE_HOSTS = 10_000  # aiohttp's DNS cache, least recently used out
# Reasons retried within a run, and marked `retryable` in rejects.jsonl: the server or the network
# may answer differently next time.
RETRYABLE = frozenset(
    {"timeout", "connection_error", "truncated", "robots_txt_unavailable", "http_408", "http_429"}
    | {f"http_{s}" for s in range(500, 600)}
)
# Retried within the run: not robots_txt_unavailable, whose answer is cached for the run.
RETRIED_NOW = RETRYABLE - {"robots_txt_unavailable"}


@dataclass(frozen=True)
class DownloadOptions:
    concurrency: int = 64  # requests in flight
    per_host: int = 8  # connections per host
    host_rate: float = 0.0  # request starts per second per origin; 0: unlimited
    connect_timeout: float = 10.0
    first_byte_timeout: float = 20.0  # from sending the request to the response's headers, and between reads
    deadline: float = 60.0  # the whole request: redirects, retries' waits and the body included
    retries: int = 3
    retry_after_cap: float = 30.0  # a longer Retry-After gives up (retryable) instead of waiting
    max_redirects: int = 5
    max_bytes: int = 64 << 20
    user_agent: str = USER_AGENT
    ignore_opt_outs: tuple[str, ...] = ()  # names from OPT_OUTS
    allow_networks: tuple[Network, ...] = ()

    def __post_init__(self):
        for name in ("concurrency", "per_host", "max_bytes"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("connect_timeout", "first_byte_timeout", "deadline"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be > 0 seconds, not {getattr(self, name)}")
        for name in ("retries", "max_redirects", "host_rate", "retry_after_cap"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # nan compares false both ways
                raise UsageError(f"{name} must be a number >= 0, not {value}")
        unknown = set(self.ignore_opt_outs) - set(OPT_OUTS)
        if unknown:
            raise UsageError(f"--ignore-opt-out {sorted(unknown)[0]!r}: the opt-outs are {', '.join(OPT_OUTS)}")


@dataclass
class Fetched:
    """One URL's outcome: `data` when it was downloaded, else `reason` (a stable code: http_404,
    timeout, opt_out_x_robots_tag, ...) and `detail`. `status`: the last HTTP status (0: none)."""

    url: str
    final_url: str = ""
    status: int = 0
    data: bytes | None = None
    reason: str = ""
    detail: str = ""
    attempts: int = 0
    content_type: str = ""
    host: str = field(default="", repr=False)

    @property
    def retryable(self) -> bool:
        return self.reason in RETRYABLE


class _Failure(Exception):
    def __init__(self, reason: str, detail: str, status: int = 0, retry_after: float | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.status, self.retry_after = reason, detail, status, retry_after


class Downloader:
    """Owns the aiohttp session and its event loop thread; `fetch_ordered` is the way in."""

    def __init__(self, options: DownloadOptions, resolver=None):
        self.options = options
        self.robots = RobotsCache(USER_AGENT_TOKEN)
        self.turns = HostTurns(options.per_host, options.host_rate)
        self._resolver_inner = resolver
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="downloads", daemon=True)
        self._thread.start()
        try:
            self._session = self._call(self._open())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open(self) -> aiohttp.ClientSession:
        o = self.options
        self._limit = asyncio.Semaphore(o.concurrency)
        # The limits are ours (self._limit, self.turns), taken before a request's clocks start;
        # aiohttp's pool, which waits inside them, is sized never to be what waits (each request in
        # flight may also be awaiting its origin's robots.txt fetch).
        connector = aiohttp.TCPConnector(
            limit=2 * o.concurrency,
            limit_per_host=0,
            use_dns_cache=True,
            ttl_dns_cache=3600,
            dns_cache_max_size=DNS_CACHE_HOSTS,
            resolver=GuardedResolver(o.allow_networks, self._resolver_inner),
            # Addresses tried one after another: a happy-eyeballs race
            # would swallow the socket guard's refusal.
            socket_factory=guarded_socket(o.allow_networks),
            happy_eyeballs_delay=None,
        )
        timeout = aiohttp.ClientTimeout(total=None, connect=o.connect_timeout, sock_read=o.first_byte_timeout)
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            headers={"User-Agent": o.user_agent},
            trust_env=False,
            auto_decompress=True,
            raise_for_status=False,
        )

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._shutdown())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        """Downloads still running (their consumer stopped early) are cancelled, then the session closed."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._session.close()

    def __enter__(self) -> Downloader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fetch_ordered(self, urls: Iterable[str | None], window: int | None = None) -> Iterator[Fetched | None]:
        """One Fetched per URL, in input order (None for None: a row with nothing to fetch). At most
        `window` (default 2 x concurrency) downloads run ahead of the consumer."""
        window = window or 2 * self.options.concurrency
        pending: deque = deque()
        try:
            for url in urls:
                pending.append(None if url is None else asyncio.run_coroutine_threadsafe(self.fetch(url), self._loop))
                if len(pending) >= window:
                    yield _result(pending.popleft())
            while pending:
                yield _result(pending.popleft())
        finally:
            for future in pending:
                if future is not None:
                    future.cancel()

    async def fetch(self, url: str) -> Fetched:
        """Never raises (but for cancellation): every outcome is a Fetched."""
        o = self.options
        try:
            host = urlsplit(url).hostname or ""
        except ValueError:
            host = ""
        result = Fetched(url, host=host)
        async with self._limit:
            try:
                async with asyncio.timeout(o.deadline) as clock:
                    await self._attempts(url, result, clock)
            except TimeoutError:
                result.reason, result.detail = "timeout", _timed_out(o)
            except (ValueError, UnicodeError) as e:  # a malformed URL or redirect target
                result.reason, result.detail = "bad_url", f"not a URL ({type(e).__name__})"
        return result

    async def _attempts(self, url: str, result: Fetched, clock: asyncio.Timeout) -> None:
        o = self.options
        loop = asyncio.get_running_loop()
        for attempt in range(o.retries + 1):
            result.attempts = attempt + 1
            try:
                await self._attempt(url, result, clock)
                return
            except _Failure as failure:
                result.reason, result.detail, result.status = failure.reason, failure.detail, failure.status
                wait = _backoff(attempt, failure.retry_after)
                if (
                    failure.reason not in RETRIED_NOW
                    or attempt == o.retries
                    or (failure.retry_after or 0) > o.retry_after_cap
                    or loop.time() + wait >= clock.when()
                ):
                    return
            await asyncio.sleep(wait)

    async def _attempt(self, url: str, result: Fetched, clock: asyncio.Timeout) -> None:
        o = self.options
        waiting = functools.partial(_paused, clock)
        seen = {url}
        for hop in range(o.max_redirects + 1):
            parts = _checked_url(url, o.allow_networks)
            origin = f"{parts.scheme}://{parts.netloc}"
            if "robots.txt" not in o.ignore_opt_outs:
                try:
                    async with waiting():
                        refused = await self.robots.verdict(origin, url, self._get_small)
                except ForbiddenAddress as e:  # robots.txt is fetched through the same guard
                    raise _Failure("forbidden_address", str(e)) from None
                if refused:
                    raise _Failure(*refused)
            async with self.turns.turn(origin, waiting):
                status, headers, body = await self._get(url)
            result.final_url, result.status = url, status
            if status in REDIRECTS and "Location" in headers:
                url = urljoin(url, headers["Location"])
                if url in seen:
                    raise _Failure("redirect_loop", f"redirected back to {url} after {hop + 1} hops", status)
                seen.add(url)
                continue
            if status != 200:
                raise _Failure(f"http_{status}", f"HTTP {status}", status, _retry_after(headers.get("Retry-After")))
            if "x-robots-tag" not in o.ignore_opt_outs:
                directive = x_robots_refusal(headers.getall("X-Robots-Tag", []), USER_AGENT_TOKEN)
                if directive:
                    raise _Failure("opt_out_x_robots_tag", f"X-Robots-Tag: {directive}", status)
            result.data, result.content_type = body, headers.get("Content-Type", "")
            result.reason = result.detail = ""
            return
        raise _Failure("too_many_redirects", f"more than {o.max_redirects} redirects", result.status)

    async def _get(self, url: str) -> tuple[int, CIMultiDictProxy[str], bytes | None]:
        """One GET without following redirects: (status, headers, body); the body only for a 200."""
        o = self.options
        try:  # connect (DNS included) and first byte: the session's ClientTimeout
            response = await self._session.get(url, allow_redirects=False)
        except TimeoutError:
            raise _Failure("timeout", _timed_out(o)) from None
        except ForbiddenAddress as e:
            raise _Failure("forbidden_address", str(e)) from None
        except aiohttp.InvalidURL as e:
            raise _Failure("bad_url", f"invalid URL {e}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise _Failure("connection_error", _describe(e)) from None
        async with response:
            if response.status != 200:
                return response.status, response.headers, None
            if (response.content_length or 0) > o.max_bytes:
                raise _Failure("too_large", f"Content-Length {response.content_length} > {o.max_bytes} bytes", 200)
            chunks, size = [], 0
            try:
                async for chunk in response.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > o.max_bytes:
                        raise _Failure("too_large", f"body over {o.max_bytes} bytes", 200)
                    chunks.append(chunk)
            except TimeoutError:
                raise _Failure("timeout", _timed_out(o), 200) from None
            except aiohttp.ClientPayloadError as e:
                raise _Failure("truncated", f"body cut short ({_describe(e)})", 200) from None
            except (aiohttp.ClientError, OSError) as e:
                raise _Failure("connection_error", _describe(e), 200) from None
            return 200, response.headers, b"".join(chunks)

    async def _get_small(self, url: str) -> tuple[int, bytes]:
        """robots.txt: redirects followed (RFC 9309: at least five), every hop guarded (ForbiddenAddress
        passes through), up to ROBOTS_MAX_BYTES read, all within one `deadline`."""
        o = self.options
        async with asyncio.timeout(o.deadline):
            for _ in range(5):
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    return 404, b""  # a redirect off the web: as if there were no robots.txt
                check_literal(parts.hostname, o.allow_networks)
                try:
                    async with self._session.get(url, allow_redirects=False) as response:
                        if response.status in REDIRECTS and "Location" in response.headers:
                            url = urljoin(url, response.headers["Location"])
                            continue
                        body = bytearray()
                        async for chunk in response.content.iter_chunked(1 << 16):  # read(n): what has arrived
                            body += chunk
                            if len(body) >= ROBOTS_MAX_BYTES:
                                break
                        return response.status, bytes(body[:ROBOTS_MAX_BYTES])
                except aiohttp.ClientError as e:
                    raise OSError(_describe(e)) from None
        return 508, b""


@contextlib.asynccontextmanager
async def _paused(clock: asyncio.Timeout):
    """The request's deadline stands still inside: it waits on other requests, not on its server."""
    loop = asyncio.get_running_loop()
    left = clock.when() - loop.time()
    clock.reschedule(None)
    try:
        yield
    finally:
        clock.reschedule(loop.time() + left)


def _result(future) -> Fetched | None:
    return None if future is None else future.result()


def _checked_url(url: str, allowed: tuple[Network, ...]):
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise _Failure("bad_url", f"not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Failure("bad_url", f"only http(s) URLs with a host can be downloaded, not {url[:80]!r}")
    if parts.username or parts.password:
        raise _Failure("bad_url", "URLs with user:password@ are not downloaded (credentials never come from a URL)")
    try:
        host = URL(url).raw_host or ""  # the host aiohttp connects to: IDNA may turn a name into an address
    except (ValueError, UnicodeError) as e:
        raise _Failure("bad_url", f"not a URL ({type(e).__name__})") from None
    try:
        check_literal(parts.hostname, allowed)
        check_literal(host, allowed)
    except ForbiddenAddress as e:
        raise _Failure("forbidden_address", str(e)) from None
    return parts


def _timed_out(o: DownloadOptions) -> str:
    """One detail for every timeout: which limit fires first is a matter of timing, and the
    rejects a list gives must not depend on timing."""
    return (
        f"no complete answer within the limits (connect {o.connect_timeout:g} s, first byte and between reads "
        f"{o.first_byte_timeout:g} s, whole request {o.deadline:g} s)"
    )


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # asctime and "-0000" dates: HTTP dates are GMT, not this machine's time
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - time.time())


def _backoff(attempt: int, retry_after: float | None) -> float:
    if retry_after is not None:
        return retry_after
    return min(8.0, 0.5 * 2**attempt) * (0.5 + random.random() / 2)  # jitter: no herd after an outage


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]
