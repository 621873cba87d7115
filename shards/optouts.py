"""Publishers' opt-outs from AI training, honoured by default: robots.txt and `X-Robots-Tag`.

robots.txt is read with the standard library's parser (RFC 9309 grouping by user agent, longest
match wins), fetched once per origin (scheme, host, port) and cached for the run; while one request
fetches it, the others for that origin wait for it instead of fetching it again. As RFC 9309 says:
a 4xx robots.txt allows everything; a 5xx or an unreachable server disallows everything (retryable
with --retry-failed). `X-Robots-Tag: noai | noimageai | noindex | none`, general or addressed to
our token (`vitforge: noai`), refuses the image; directives addressed to other crawlers do not.

Per process: one parsed robots.txt per origin the list names (at most 500 KiB each, RFC 9309's cap).
"""

from __future__ import annotations

import asyncio
from urllib.robotparser import RobotFileParser

OPT_OUTS = ("robots.txt", "x-robots-tag")  # the names --ignore-opt-out takes
REFUSING_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "none"})
ROBOTS_MAX_BYTES = 500 * 1024


def x_robots_refusal(values: list[str], token: str) -> str | None:
    """The directive in `X-Robots-Tag` header values that refuses us, or None. Each value is a
    comma-separated list of directives, optionally preceded by `crawler-name:` (which then applies
    to the rest of that value)."""
    token = token.lower()
    for value in values:
        target = None
        for part in value.split(","):
            part = part.strip().lower()
            if ":" in part:
                name, _, rest = part.partition(":")
                if name.strip() and " " not in name.strip() and name.strip() not in ("unavailable_after",):
                    target, part = name.strip(), rest.strip()
            if part in REFUSING_DIRECTIVES and target in (None, token):
                return f"{target + ': ' if target else ''}{part}"
    return None


class RobotsCache:
    """robots.txt per origin: `verdict(origin, url, fetch)` fetches it at most once per run, in a
    task of its own (a request cancelled by its deadline does not cancel the fetch the others
    wait on). `fetch(robots_url)` returns (status, body) or raises OSError / asyncio.TimeoutError."""

    def __init__(self, user_agent_token: str):
        self.token = user_agent_token
        self._loads: dict[str, asyncio.Task] = {}

    async def verdict(self, origin: str, url: str, fetch) -> tuple[str, str] | None:
        """None when `url` may be fetched; otherwise (reason, detail): `opt_out_robots_txt` (final)
        or `robots_txt_unavailable` (retryable)."""
        load = self._loads.get(origin)
        if load is None:
            load = self._loads[origin] = asyncio.ensure_future(_load(origin, fetch))
        parser = await asyncio.shield(load)
        if isinstance(parser, str):
            return "robots_txt_unavailable", parser
        if parser.can_fetch(self.token, url):
            return None
        return "opt_out_robots_txt", f"robots.txt of {origin} disallows it for {self.token}"

    @property
    def origins(self) -> int:
        return len(self._loads)


async def _load(origin: str, fetch) -> RobotFileParser | str:
    """The parsed robots.txt of `origin`, or why it counts as disallowing everything."""
    try:
        status, body = await fetch(f"{origin}/robots.txt")
    except (OSError, asyncio.TimeoutError) as e:
        return f"robots.txt of {origin} unreachable ({type(e).__name__}): RFC 9309 says disallow"
    parser = RobotFileParser()
    if 400 <= status < 500:
        parser.parse([])  # no robots.txt: everything allowed
    elif 200 <= status < 300:
        parser.parse(body[:ROBOTS_MAX_BYTES].decode("utf-8", "replace").splitlines())
    else:
        return f"robots.txt of {origin} answered HTTP {status}: RFC 9309 says disallow"
    return parser
