"""Per-host turns (shards/host_turns.py): the per-host cap holds, and the per-origin state stays
bounded however many hosts a list names."""

from __future__ import annotations

import asyncio
import contextlib

from vitforge.shards.host_turns import HostTurns


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
