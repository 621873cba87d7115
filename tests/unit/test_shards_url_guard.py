"""The downloader's request-forgery guard (shards/url_guard.py): IPv6 forms that carry a refused IPv4
address are refused, those of public addresses and allowed networks pass."""

from __future__ import annotations

import ipaddress

import pytest

from vitforge.shards.url_guard import refusal


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
