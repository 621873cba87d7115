"""A stored shard plan as every task reads it: the header, then only the slices that hold its shards.

The planner (plan.py) stores the plan as gzip'd JSON-lines slices (one per part of the job, or
one per bucket when the array planned it) and a small header written last (the commit mark), so
a task reads only the slices that hold its shards and a plan cut short is never taken for
complete. The header is small whatever the corpus size; a task holds its slices' items only.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from vitforge.core import UsageError

from .layout import FIRST, Work

PLAN_FORMAT = "vitforge.shard-plan"
PLAN_FORMAT_VERSION = 2
SLICED_FORMAT_VERSION = 3  # slices numbered within themselves (slice_shards): what an older vitforge cannot read


@dataclass
class PlanItem:
    key: str
    source: str
    label: int | None
    meta: dict = field(default_factory=dict)
    problem: list | None = None


@dataclass
class PlanHeader:
    """What every task and the merge read: small, whatever the corpus size. An extension's plan
    (`--extend`) numbers its shards and sample keys on from the version it extends."""

    fingerprint: str
    parameters: dict
    classes: list[str]
    inputs: int
    shards: int
    parts: int  # the slices were cut for this many parts
    duplicates: int
    first_shard: int = 0  # the number of this plan's first shard
    first_position: int = 0  # the position (sample key) of this plan's first input
    retried: int = 0  # a retry's rows, each a reject of an earlier version (`--retry-failed`)
    job: str | None = None  # the array job that planned a retry ("slurm:1234"), so its late tasks know it
    # A plan made across the array has one slice per bucket, its lines numbered within the slice:
    # each slice's shards and inputs, in order (None: slices of equal shard ranges, numbered globally).
    slice_shards: list[int] | None = None
    slice_inputs: list[int] | None = None

    def shard_range(self, part: int, num_parts: int) -> range:
        """The shard numbers `part` of `num_parts` builds."""
        local = part_range(self.shards, part, num_parts)
        return range(self.first_shard + local.start, self.first_shard + local.stop)

    def all_shards(self) -> range:
        return range(self.first_shard, self.first_shard + self.shards)

    def slices_holding(self, shards: range) -> list[int]:
        """The slices that hold any of `shards`: a task reads the one or few slices that overlap its
        shards (one when its --num-parts is the planner's)."""
        return [
            p
            for p in range(self.parts)
            if (r := self.slice_range(p)) and r.start < shards.stop and shards.start < r.stop
        ]

    def slice_range(self, p: int) -> range:
        """The shard numbers slice `p` holds."""
        if self.slice_shards is None:
            return self.shard_range(p, self.parts)
        start = self.first_shard + sum(self.slice_shards[:p])
        return range(start, start + self.slice_shards[p])

    def slice_numbering(self, p: int) -> tuple[int, int]:
        """What to add to slice `p`'s shard and position numbers to make them the dataset's."""
        if self.slice_shards is None:
            return 0, 0
        return self.slice_range(p).start, self.first_position + sum(self.slice_inputs[:p])

    def to_bytes(self) -> bytes:
        optional = ("first_shard", "first_position", "retried", "job", "slice_shards", "slice_inputs")
        fields = {k: v for k, v in asdict(self).items() if v or k not in optional}
        version = PLAN_FORMAT_VERSION if self.slice_shards is None else SLICED_FORMAT_VERSION
        return json.dumps(
            {"format": PLAN_FORMAT, "format_version": version, **fields}, sort_keys=True, indent=1
        ).encode()

    @staticmethod
    def from_bytes(data: bytes, where: str) -> PlanHeader:
        raw = json.loads(data)
        if raw.pop("format", None) != PLAN_FORMAT or raw.pop("format_version", None) not in (
            PLAN_FORMAT_VERSION,
            SLICED_FORMAT_VERSION,
        ):
            raise UsageError(f"{where}: not a {PLAN_FORMAT} v{PLAN_FORMAT_VERSION} or v{SLICED_FORMAT_VERSION} header")
        return PlanHeader(**raw)


def read_header(store, work: Work = FIRST) -> PlanHeader | None:
    try:
        return PlanHeader.from_bytes(store.get_bytes(work.header), store.url(work.header))
    except FileNotFoundError:
        return None


def load_slice(store, header: PlanHeader, part: int, num_parts: int, work: Work = FIRST) -> dict[int, list[PlanItem]]:
    """The items of the shards part `part` of `num_parts` builds, shard number -> items; reads only
    the slices that hold them (one when `num_parts` is the planner's)."""
    owned = header.shard_range(part, num_parts)
    shards: dict[int, list[PlanItem]] = {i: [] for i in owned}
    for p in header.slices_holding(owned):
        data = read_slice(store, p, work)
        first_shard, first_position = header.slice_numbering(p)
        # One parse for the whole slice: lines hold no raw newline (JSON escapes it).
        for shard, key, *fields in json.loads(b"[" + data.rstrip(b"\n").replace(b"\n", b",") + b"]"):
            if shard + first_shard in shards:
                key = f"{int(key) + first_position:09d}" if first_position else key
                shards[shard + first_shard].append(PlanItem(key, *fields))
    return shards


def plan_lines(store, header: PlanHeader, work: Work = FIRST) -> Iterator[tuple[str, bytes]]:
    """Every planned row as (its sample key, the rest of its line: source, label, meta, problem)."""
    for p in range(header.parts):
        first_position = header.slice_numbering(p)[1]
        for line in read_slice(store, p, work).splitlines():
            _, quoted, rest = line[1:].split(b",", 2)  # [shard,"key",... : neither holds a comma
            key = json.loads(quoted)
            yield (f"{int(key) + first_position:09d}" if first_position else key), rest


def read_slice(store, part: int, work: Work = FIRST) -> bytes:
    """One slice of a complete plan, decompressed: JSON lines [shard, key, source, label, meta, problem]."""
    try:
        return gzip.decompress(store.get_bytes(work.slice(part)))
    except FileNotFoundError:
        raise UsageError(
            f"{store.url(work.slice(part))}: a slice of a complete plan is missing; delete "
            f"{store.url(work.plan_dir)} and rerun to plan again (same inputs, same plan)"
        ) from None


def part_range(total: int, part: int, num_parts: int) -> range:
    """The shards (or rows) of `total` that `part` of `num_parts` takes: consecutive, as even as can be."""
    return range(part * total // num_parts, (part + 1) * total // num_parts)
