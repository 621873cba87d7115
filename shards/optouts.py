"""Publishers' opt-outs from AI training, honoured by default: robots.txt and `X-Robots-Tag`.

robots.txt is read with protego (RFC 9309: the group for our product token, else `*`; the longest
match wins; `*` and `$` patterns; protego also takes a group named by a word of our token, `vit`
for `vitforge`, which can only refuse more), fetched once per origin (scheme, host, port) and cached; while one
request fetches it, the others for that origin wait for it instead of fetching it again. As RFC
9309 says: a 4xx robots.txt allows everything; a 5xx or an unreachable server disallows everything
(a retryable reject); at most 500 KiB is read. `X-Robots-Tag: noai | noimageai |
noindex | none`, general or addressed to our token (`vitforge: noai`), refuses the image;
directives addressed to other crawlers do not.

Per process: the parsed robots.txt of the origins used most recently, within `max_bytes` (64 MiB
by default), each counted as PARSED_BYTES_PER_BYTE x its text (protego's parse of a 62 KB
robots.txt held 1.8 MB) plus ENTRY_BYTES, so at most 262,144 origins; an origin evicted and met
again is fetched again. In-flight fetches are bounded by the
downloads in flight.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from protego import Protego

OPT_OUTS = ("robots.txt", "x-robots-tag")  # the names --ignore-opt-out takes
REFUSING_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "none"})
# Directives written `name: value`: their name is not a crawler's (`max-image-preview:large, noai`
# is addressed to every crawler).
VALUED_DIRECTIVES = frozenset({"max-snippet", "max-image-preview", "max-video-preview", "unavailable_after"})
ROBOTS_MAX_BYTES = 500 * 1024
ENTRY_BYTES = 256  # counted for every cached origin, whatever its robots.txt's size
PARSED_BYTES_PER_BYTE = 32
ALLOW_ALL = "allow all"  # a 4xx robots.txt


def x_robots_refusal(values: list[str], token: str) -> str | None:
    """The directive in `X-Robots-Tag` header values that refuses us, or None. Each value is a
    comma-separated list of directives, optionally preceded by `crawler-name:` (which then applies
    to the rest of that value)."""
    token = token.lower()
    for value in values:
        target = None
        for part in value.split(","):
            part = part.strip().lower()
            name, colon, rest = part.partition(":")
            name = name.strip()
            if colon and name and " " not in name and name not in VALUED_DIRECTIVES:
                target, part = name, rest.strip()
            if part in REFUSING_DIRECTIVES and target in (None, token):
                return f"{target + ': ' if target else ''}{part}"
    return None


class RobotsCache:
    """robots.txt per origin: `verdict(origin, url, fetch)` fetches it once while it stays cached,
    in a task of its own (a request cancelled by its deadline does not cancel the fetch the others
    wait on). `fetch(robots_url)` returns (status, body) or raises OSError / asyncio.TimeoutError."""

    def __init__(self, user_agent_token: str, max_bytes: int = 64 << 20):
        self.token = user_agent_token
        self.max_bytes = max_bytes
        self.fetches = 0  # robots.txt requests started (an origin evicted and met again counts twice)
        self._loads: OrderedDict[str, asyncio.Future] = OrderedDict()  # least recently used first
        self._sizes: dict[str, int] = {}
        self._held = 0

    async def verdict(self, origin: str, url: str, fetch) -> tuple[str, str] | None:
        """None when `url` may be fetched; otherwise (reason, detail): `opt_out_robots_txt` (final)
        or `robots_txt_unavailable` (retryable)."""
        load = self._loads.get(origin)
        if load is None:
            load = self._loads[origin] = asyncio.ensure_future(_load(origin, fetch))
            load.add_done_callback(lambda done: self._loaded(origin, done))
            self.fetches += 1
        else:
            self._loads.move_to_end(origin)
        rules, _ = await asyncio.shield(load)
        if isinstance(rules, str):
            if rules == ALLOW_ALL:
                return None
            return "robots_txt_unavailable", rules
        if rules.can_fetch(url, self.token):
            return None
        return "opt_out_robots_txt", f"robots.txt of {origin} disallows it for {self.token}"

    def _loaded(self, origin: str, done: asyncio.Future) -> None:
        if done.cancelled():  # the downloader shutting down
            del self._loads[origin]
            return
        # A fetch refused by the request-forgery guard stays cached too: every request re-raises it.
        self._sizes[origin] = ENTRY_BYTES + (0 if done.exception() else PARSED_BYTES_PER_BYTE * done.result()[1])
        self._held += self._sizes[origin]
        for old in list(self._loads):
            if self._held <= self.max_bytes:
                break
            if old in self._sizes:  # a fetch still running is never evicted
                del self._loads[old]
                self._held -= self._sizes.pop(old)

    @property
    def origins(self) -> int:
        return len(self._loads)


async def _load(origin: str, fetch) -> tuple[Protego | str, int]:
    """The parsed robots.txt of `origin` (ALLOW_ALL, or why it counts as disallowing everything),
    and the bytes it holds."""
    try:
        status, body = await fetch(f"{origin}/robots.txt")
    except (TimeoutError, OSError) as e:
        return f"robots.txt of {origin} unreachable ({type(e).__name__}): RFC 9309 says disallow", 0
    if 400 <= status < 500:
        return ALLOW_ALL, 0
    if not 200 <= status < 300:
        return f"robots.txt of {origin} answered HTTP {status}: RFC 9309 says disallow", 0
    body = body[:ROBOTS_MAX_BYTES]
    return Protego.parse(body.decode("utf-8", "replace")), len(body)
