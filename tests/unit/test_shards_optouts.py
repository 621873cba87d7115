"""The URL-list downloader's opt-outs (shards/optouts.py): robots.txt read as RFC 9309 says, through a
cache bounded in bytes however many hosts a list names, and X-Robots-Tag directives and their
addressees."""

from __future__ import annotations

import asyncio

import pytest

from vitforge.shards.optouts import ENTRY_BYTES, PARSED_BYTES_PER_BYTE, RobotsCache, x_robots_refusal

ROBOTS = """\
User-agent: vit
Disallow: /

User-agent: vitforgebot
Disallow: /

User-agent: vitforge
Disallow: /a
Allow: /a/open
Disallow: /*.png$
"""


def _verdicts(text: str, urls: list[str], status: int = 200) -> list:
    async def fetch(url):
        return status, text.encode()

    async def run():
        cache = RobotsCache("vitforge")
        return [await cache.verdict("http://h", url, fetch) for url in urls]

    return asyncio.run(run())


def test_robots_txt_is_read_as_rfc_9309_says():
    urls = ["http://h/a/open/x.jpg", "http://h/a/closed.jpg", "http://h/b/x.png", "http://h/b/x.png?s=1",
            "http://h/b/x.jpg"]
    allowed = [verdict is None for verdict in _verdicts(ROBOTS, urls)]
    # The longest match wins (/a/open over /a), `*` and `$` are patterns, and only the group named
    # exactly `vitforge` applies (not `vit`, which the standard library's parser matches as a
    # substring, nor `vitforgebot`).
    assert allowed == [True, False, False, True, True]
    assert _verdicts(ROBOTS, ["http://h/a"])[0] == ("opt_out_robots_txt", "robots.txt of http://h disallows it for "
                                                                           "vitforge")
    assert _verdicts("", ["http://h/x"], status=404) == [None]
    assert _verdicts("", ["http://h/x"], status=503)[0][0] == "robots_txt_unavailable"


def test_the_robots_cache_is_bounded_in_bytes_and_refetches_what_it_evicted():
    fetched = []

    async def fetch(url):
        fetched.append(url)
        return 200, b"User-agent: *\nDisallow: /private/\n" + b"#" * 1000

    async def run():
        cache = RobotsCache("vitforge", max_bytes=10 * (ENTRY_BYTES + PARSED_BYTES_PER_BYTE * 1035))
        for i in range(100):
            assert await cache.verdict(f"http://h{i}", f"http://h{i}/private/x", fetch) is not None
        held = cache.origins
        assert await cache.verdict("http://h99", "http://h99/x", fetch) is None  # cached: no fetch
        assert len(fetched) == 100
        await cache.verdict("http://h0", "http://h0/x", fetch)  # evicted long ago: fetched again
        return held, cache.fetches

    held, fetches = asyncio.run(run())
    assert held == 10 and fetches == 101 and fetched[-1] == "http://h0/robots.txt"


@pytest.mark.parametrize("values, refusal_found", [
    (["noai"], "noai"),
    (["max-image-preview:large, noai"], "noai"),  # a valued directive is not a crawler's name
    (["max-snippet: 20, noimageai"], "noimageai"),
    (["unavailable_after: 2030-01-01, noindex"], "noindex"),
    (["otherbot: noai"], None),
    (["otherbot: noindex, nofollow", "vitforge: none"], "vitforge: none"),
    (["googlebot: noai, vitforge: noimageai"], "vitforge: noimageai"),
    (["nofollow, noarchive"], None),
])
def test_x_robots_tag_directives_and_their_addressees(values, refusal_found):
    assert x_robots_refusal(values, "vitforge") == refusal_found
