"""The URL-list downloader's rules, in-process: opt-out parsing (RFC 9309 robots.txt through the
cache, X-Robots-Tag), the request-forgery guard's IPv6 forms, Retry-After dates, option checks, and
per-origin state that stays bounded however many hosts a list names."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import ipaddress
import time

import pytest

from vitforge.core import UsageError
from vitforge.shards import DownloadOptions
from vitforge.shards.download import _retry_after
from vitforge.shards.host_turns import HostTurns
from vitforge.shards.optouts import ENTRY_BYTES, PARSED_BYTES_PER_BYTE, RobotsCache, x_robots_refusal
from vitforge.shards.url_guard import refusal

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


@pytest.mark.parametrize("address, carried", [
    ("64:ff9b::a00:1", "10.0.0.1"),  # NAT64
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"),
    ("2002:7f00:1::1", "127.0.0.1"),  # 6to4
    ("::a00:1", "10.0.0.1"),  # IPv4-compatible
    ("::ffff:169.254.169.254", "169.254.169.254"),  # IPv4-mapped
    ("::ffff:0:7f00:1", "127.0.0.1"),  # IPv4-translated
])
def test_ipv6_forms_that_carry_a_refused_ipv4_address_are_refused(address, carried):
    assert f"carries an IPv4 address: {carried} is" in refusal(address, ())


def test_ipv6_forms_of_public_addresses_and_allowed_networks_pass():
    assert refusal("64:ff9b::808:808", ()) is None and refusal("2002:808:808::1", ()) is None
    assert "not globally routable" in refusal("64:ff9b:1::808:808", ())  # local-use NAT64: any address
    assert refusal("64:ff9b::a00:1", (ipaddress.ip_network("10.0.0.0/8"),)) is None


def test_retry_after_dates_are_gmt_whatever_the_local_zone(monkeypatch):
    when = time.time() + 20
    forms = [email.utils.formatdate(when, usegmt=True),  # IMF-fixdate
             time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(when))]  # asctime: no zone
    for zone in ("UTC", "America/New_York", "Asia/Tokyo"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        for form in forms:
            assert 15 < _retry_after(form) <= 21, (zone, form)
    monkeypatch.undo()
    time.tzset()
    assert _retry_after("7") == 7 and _retry_after("soon") is None


@pytest.mark.parametrize("field", ["host_rate", "retry_after_cap", "retries", "max_redirects"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1])
def test_options_refuse_values_that_are_not_numbers_at_least_zero(field, value):
    with pytest.raises(UsageError, match=f"{field} must be a number >= 0"):
        DownloadOptions(**{field: value})


def test_host_turns_hold_the_per_host_cap_and_keep_nothing_per_host_afterwards():
    turns = HostTurns(per_host=2, rate=1e6)
    inside: dict[str, int] = {}
    most: dict[str, int] = {}
    clocks = []

    async def request(origin):
        async with turns.turn(origin, contextlib.nullcontext):
            inside[origin] = inside.get(origin, 0) + 1
            most[origin] = max(most.get(origin, 0), inside[origin])
            await asyncio.sleep(0.001)
            inside[origin] -= 1

    async def run():
        await asyncio.gather(*(request(f"http://h{i % 500}") for i in range(2000)))
        assert not turns._slots  # 500 hosts seen, no slot entry left
        for i in range(1000):  # a list of 1,000 more hosts, one request each
            async with turns.turn(f"http://n{i}", contextlib.nullcontext):
                clocks.append(len(turns._next_start))

    asyncio.run(run())
    assert max(most.values()) == 2 and len(most) == 500
    assert max(clocks) <= 65  # rate clocks whose start has passed are dropped
