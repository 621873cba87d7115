"""Pack image corpora into validated, DALI-ready WebDataset shards (`vitforge shard`)."""

from .build import PartResult, ShardJob, ensure_plan, merge_parts, run
from .download import Downloader, DownloadOptions, Fetched
from .images import ImageOptions, Rejected, normalise
from .layout import MANIFEST_NAME, manifest_version
from .manifest import ManifestError, read_manifest
from .sources import SourceError
from .tarfile_writer import SAMPLE_IMAGE_EXTS, TarShardWriter, index_path_for, index_tar
from .verify import info, verify

__all__ = [
    "MANIFEST_NAME",
    "SAMPLE_IMAGE_EXTS",
    "DownloadOptions",
    "Downloader",
    "Fetched",
    "ImageOptions",
    "ManifestError",
    "PartResult",
    "Rejected",
    "ShardJob",
    "SourceError",
    "TarShardWriter",
    "ensure_plan",
    "index_path_for",
    "index_tar",
    "info",
    "manifest_version",
    "merge_parts",
    "normalise",
    "read_manifest",
    "run",
    "verify",
]
