"""What listing a corpus yields: a stream of SourceRecord and the class map (a Corpus), or a
SourceError when the corpus as a whole cannot be read."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vitforge.core import UsageError


class SourceError(UsageError):
    """The corpus as a whole cannot be read (not one bad sample: those become rejects)."""


@dataclass
class SourceRecord:
    source: str  # local path or store URL; may hold surrogate escapes for non-UTF-8 names
    label: int | None  # None: the corpus is unlabelled, or (with a problem) the label is not in the class map
    size: int = 0  # bytes on the source, used to plan shard sizes; 0 when unknown
    meta: dict = field(default_factory=dict)
    problem: tuple[str, str] | None = None  # (reason, detail) when the row can never be packed
    name: str = ""  # the source as the corpus names it (path under SRC, or the manifest's path cell)
    # Records sharing a group are shuffled among themselves and kept together, the groups shuffled
    # as wholes: a Parquet file's embedded images are read a window of row groups at a time.
    group: str = ""

    def __post_init__(self):
        self.name = self.name or self.source


@dataclass
class Corpus:
    """`records`: the listing in its stable order, streamed: iterate it once and keep what is needed
    (per input, a listing holds only the folders of a tree, the distinct labels of a manifest and
    a bounded window of records). `classes`: class id -> name, empty for an unlabelled corpus; for
    class folders without a class map it grows as the records are drawn, complete once they are."""

    records: Iterable[SourceRecord]
    classes: list[str]


def display_path(path: str) -> str:
    """A printable, valid-UTF-8 form of a path whose bytes may not be UTF-8."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
