"""Where everything lives in a destination (DEST), for every version of a dataset.

PREFIX-000000.tar, PREFIX-000000.idx, ...   the shards and their DALI indexes, of every version
dataset.json                                the latest version; written last, a reader trusts nothing else
dataset.v1.json, dataset.v2.json, ...       each version's manifest, never rewritten (a pinned reader's)
rejects.jsonl, duplicates.jsonl             what was left out, with the source and the reason (all versions)
_work/                                      version 1's work; _work/vN/ holds version N's (`--extend`):
  plan/header.json                          the shard plan's header (written last: its commit mark)
  plan/part-00000.jsonl.gz, ...             the plan's items, one slice per part of the job (or per
                                            bucket, for a plan made in shares: shards/array_plan.py)
  plan/spread/                              a plan in shares while it is made: spread.json (share count,
                                            fingerprint), labels-, spill- and bucket-NNNNN.json (each
                                            unit's result), spill-NNNNN-RRRR-TOKEN.bin (a share's runs),
                                            *.claim; deleted once the header exists
  plan/duplicates.jsonl.gz                  the duplicates the plan found
  plan/digests.bin                          the planned inputs' content digests (deduplicated plans)
  plan/claim.json                           which task plans (only while it plans)
  shards/PREFIX-000000.tar.json             one record per finished shard (its commit mark)
  base-rejects.jsonl, base-duplicates.jsonl the version extended's, as its plan found them (vN only)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MANIFEST_NAME = "dataset.json"
REJECTS_NAME = "rejects.jsonl"
DUPLICATES_NAME = "duplicates.jsonl"
_VERSIONED = re.compile(r"dataset\.v([1-9][0-9]*)\.json")


def versioned_manifest_name(version: int) -> str:
    return f"dataset.v{version}.json"


def manifest_version(name: str) -> int | None:
    """N for "dataset.vN.json", None for any other name."""
    match = _VERSIONED.fullmatch(name)
    return int(match.group(1)) if match else None


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


@dataclass(frozen=True)
class Work:
    """The work files of one version of a dataset: the first under `_work/`, version N under `_work/vN/`."""

    root: str = "_work"

    @classmethod
    def of(cls, version: int) -> Work:
        return cls() if version == 1 else cls(f"_work/v{version}")

    @property
    def plan_dir(self) -> str:
        return f"{self.root}/plan"

    @property
    def header(self) -> str:
        return f"{self.plan_dir}/header.json"

    @property
    def duplicates(self) -> str:
        return f"{self.plan_dir}/duplicates.jsonl.gz"

    @property
    def digests(self) -> str:
        return f"{self.plan_dir}/digests.bin"

    @property
    def claim(self) -> str:
        return f"{self.plan_dir}/claim.json"

    @property
    def records_dir(self) -> str:
        return f"{self.root}/shards"

    @property
    def legacy_plan(self) -> str:
        return f"{self.root}/plan.json.gz"  # one file holding everything (vitforge before plan slices)

    @property
    def base_rejects(self) -> str:
        return f"{self.root}/base-{REJECTS_NAME}"

    @property
    def base_duplicates(self) -> str:
        return f"{self.root}/base-{DUPLICATES_NAME}"

    def slice(self, part: int) -> str:
        return f"{self.plan_dir}/part-{part:05d}.jsonl.gz"

    def record(self, shard: str) -> str:
        return f"{self.records_dir}/{shard}.json"


FIRST = Work()
