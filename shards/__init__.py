"""Pack image corpora into validated, DALI-ready WebDataset shards (`vitforge shard`)."""

from .download import Downloader, DownloadOptions, Fetched  # noqa: E402
from .build import PartResult, ShardJob, ensure_plan, merge_parts, run  # noqa: E402
from .images import ImageOptions, Rejected, normalise  # noqa: E402
from .layout import MANIFEST_NAME, manifest_version  # noqa: E402
from .manifest import ManifestError, read_manifest  # noqa: E402
from .sources import SourceError  # noqa: E402
from .tarfile_writer import SAMPLE_IMAGE_EXTS, TarShardWriter, index_path_for, index_tar  # noqa: E402
from .verify import info, verify  # noqa: E402

__all__ = [
    "Downloader", "DownloadOptions", "Fetched", "ImageOptions", "MANIFEST_NAME", "SAMPLE_IMAGE_EXTS", "ManifestError",
    "PartResult", "Rejected", "ShardJob",
    "SourceError", "ensure_plan",
    "TarShardWriter", "index_path_for", "index_tar", "info", "manifest_version", "merge_parts", "normalise",
    "read_manifest", "run", "verify",
]
