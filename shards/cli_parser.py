"""`vitforge shard`'s command lines: the parsers of a sharding run, `--retry-failed`, `merge`,
`verify` and `info`, and the argument types they read sizes with (cli.py runs what they parse)."""

from __future__ import annotations

import argparse
import os
import re

from vitforge.core.cli_args import bounded, non_negative_int, positive_float, positive_int

from .download import USER_AGENT, DownloadOptions
from .images import ImageOptions
from .optouts import OPT_OUTS

DESCRIPTION = """\
Pack an image corpus into WebDataset tar shards with DALI index files and a dataset.json manifest.

  vitforge shard SRC DEST [options]      shard a corpus (resumable: rerun the same command after a crash)
  vitforge shard SRC DEST --extend       add SRC to DEST's dataset as a new version (old shards untouched)
  vitforge shard --retry-failed DEST     download a URL-list dataset's retryable failures again (a new version)
  vitforge shard merge DEST              combine the parts of a --num-parts run into dataset.json
  vitforge shard verify DEST             re-read every shard and check it against the manifest
  vitforge shard info DEST               summarise a sharded dataset

SRC is a class-folder tree (SRC/CLASS/IMAGE, as ImageNet's train split) or a CSV / TSV / JSONL /
Parquet manifest with a path column and a label column; DEST is a folder or an s3:// prefix.
With --no-labels, SRC is any folder of images (at any depth) or a manifest with only a path
column, and the samples carry no label: for self-supervised pre-training (masked patch prediction).
With --url-col, SRC is a URL list (CSV / TSV / JSONL / Parquet, as LAION's and DataComp's):
each row's image is downloaded (opt-outs honoured, private addresses refused, retried within a
deadline) and then validated and packed like a local image; failures are rows of rejects.jsonl.
Object-store endpoint and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_PROFILE, AWS_ACCESS_KEY_ID ...)."""
RETRY_DESCRIPTION = """\
Download a URL-list dataset's retryable failures again (timeouts, connection errors, 408, 429,
5xx, robots.txt unavailable: rejects.jsonl's rows with "retryable": true), as a new version of
the dataset (see --extend): each row that now downloads becomes a sample under the key it always
had; the others stay rejects. Rows are fetched with the user agent, opt-outs, allowed networks
and limits they were listed with; only the timing options below may differ. Run it again to
retry what still fails."""
URL_LIST_SHARD_SAMPLES = 10_000  # a URL list has no sizes before downloading: shards close by count

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1GiB, 500MB, 100000)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vitforge shard", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("src", help="class-folder tree or manifest (.csv/.tsv/.jsonl/.parquet), local or URL")
    p.add_argument("dest", help="output folder or s3:// prefix")
    _layout_arguments(p)
    _image_arguments(p)
    _label_arguments(p)
    _url_arguments(p)
    _version_arguments(p)
    _execution_arguments(p)
    return p


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    """Where shards close, what they are named and the order of the samples in them."""
    size = p.add_argument_group("shard size (a shard closes at whichever limit comes first)")
    size.add_argument(
        "--shard-bytes",
        type=parse_size,
        default=1 << 30,
        help="target bytes per shard, planned from source sizes (default 1GiB; 0 = no byte limit)",
    )
    size.add_argument("--shard-samples", type=positive_int, default=None, help="at most this many samples per shard")
    order = p.add_argument_group("naming and order")
    order.add_argument("--prefix", default="train", help="shard names are PREFIX-000000.tar (default train)")
    order.add_argument("--seed", type=int, default=0, help="global shuffle seed (default 0)")


def _image_arguments(p: argparse.ArgumentParser) -> None:
    """What is packed of each image: kept or re-encoded, resized, validated, deduplicated."""
    image = p.add_argument_group("images")
    image.add_argument(
        "--format",
        choices=("keep", "jpeg"),
        default="keep",
        help="keep: JPEG/PNG/WebP stay as they are; jpeg: re-encode everything else as JPEG",
    )
    image.add_argument(
        "--quality", type=bounded(int, 1, 100), default=95, help="JPEG quality when re-encoding (default 95)"
    )
    image.add_argument(
        "--max-side", type=positive_int, default=None, help="downscale images whose longer side exceeds N"
    )
    image.add_argument("--min-side", type=positive_int, default=1, help="reject images whose shorter side is under N")
    image.add_argument(
        "--max-pixels",
        type=positive_int,
        default=ImageOptions.max_pixels,
        help=f"reject larger images as decompression bombs (default {ImageOptions.max_pixels})",
    )
    image.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="pack bytes as they are, without decoding (only for corpora you already trust)",
    )
    image.add_argument("--dedup", action="store_true", help="drop exact duplicates (same content sha256)")


def _label_arguments(p: argparse.ArgumentParser) -> None:
    """Where each sample's label comes from, and which inputs a folder or manifest may name."""
    labels = p.add_argument_group("labels")
    labels.add_argument(
        "--classes",
        dest="classes_file",
        default=None,
        help="class names: a text file (one per line), a JSON list/dict, or another dataset.json",
    )
    labels.add_argument(
        "--no-labels",
        dest="labels",
        action="store_false",
        help="an unlabelled corpus: every image under SRC, or every manifest row, without a label",
    )
    labels.add_argument("--path-column", default="path", help="manifest column with the image path (default path)")
    labels.add_argument(
        "--label-column", "--label-col", default="label", help="manifest column with the label (default label)"
    )
    labels.add_argument(
        "--image-col",
        dest="image_column",
        default=None,
        help="SRC is a Parquet file in the Hugging Face datasets layout: this column holds "
        "struct<bytes, path> images (class names from its ClassLabel metadata)",
    )
    labels.add_argument(
        "--root",
        default=None,
        help="manifest paths must resolve inside this folder or URL prefix (default: the manifest's "
        "own folder; --root / allows any local path); rows outside it are rejected",
    )
    labels.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="follow symlinked folders below a folder SRC (default: skipped, with a warning); "
        "only those leading inside SRC, or inside --root when given, and each real folder once",
    )


def _version_arguments(p: argparse.ArgumentParser) -> None:
    """Adding a corpus to a finished dataset as a new version."""
    versions = p.add_argument_group(
        "extending a dataset (each version's manifest stays as dataset.vN.json: a reader or run that names "
        "it keeps reading that set)"
    )
    versions.add_argument(
        "--extend",
        action="store_true",
        help="add SRC to the finished dataset in DEST as a new version: new shards numbered on, "
        "class ids kept (new classes appended), exact duplicates of anything already in "
        "it (or in SRC) left out; image settings and --prefix must be the dataset's",
    )
    versions.add_argument(
        "--verify-existing",
        action="store_true",
        help="with --extend: re-read every existing shard against its checksum first "
        "(default: the manifest's checksums are trusted)",
    )


def _url_arguments(p: argparse.ArgumentParser) -> None:
    d = DownloadOptions()
    urls = p.add_argument_group(
        "URL lists (SRC a manifest of http(s) URLs; shards close at "
        f"{URL_LIST_SHARD_SAMPLES} samples unless --shard-samples says otherwise)"
    )
    urls.add_argument(
        "--url-col",
        dest="url_column",
        default=None,
        help="the column holding each row's image URL: makes SRC a URL list to download",
    )
    urls.add_argument(
        "--caption-col",
        dest="caption_column",
        default=None,
        help="a caption column: each sample's .txt member (and kept in its JSON)",
    )
    urls.add_argument(
        "--meta-col",
        dest="meta_columns",
        action="append",
        default=None,
        metavar="COL",
        help="a column kept in each sample's JSON (repeatable; default: every column)",
    )
    _timing_arguments(urls)
    urls.add_argument(
        "--max-body",
        type=parse_size,
        default=d.max_bytes,
        metavar="SIZE",
        help=f"refuse larger downloads (default {d.max_bytes >> 20}MiB)",
    )
    urls.add_argument(
        "--max-redirects",
        type=non_negative_int,
        default=d.max_redirects,
        help=f"default {d.max_redirects}; a redirect loop fails at once",
    )
    urls.add_argument("--user-agent", default=USER_AGENT, help="names the project and a contact by default")
    urls.add_argument(
        "--ignore-opt-out",
        dest="ignore_opt_outs",
        action="append",
        default=[],
        choices=OPT_OUTS,
        help="do not honour this opt-out (robots.txt or x-robots-tag); by name, one at a time",
    )
    urls.add_argument(
        "--allow-network",
        dest="allow_networks",
        action="append",
        default=[],
        metavar="CIDR",
        help="let downloads reach this network although it is loopback, private or link-local "
        "(refused by default: a crawled list must not reach a node's metadata endpoint)",
    )


def _timing_arguments(group) -> None:
    """How fast and how patiently URLs are downloaded: never what a success holds."""
    d = DownloadOptions()
    group.add_argument(
        "--concurrency",
        type=positive_int,
        default=d.concurrency,
        help=f"downloads in flight (default {d.concurrency}); the output is the same for any value",
    )
    group.add_argument(
        "--per-host", type=positive_int, default=d.per_host, help=f"connections per host (default {d.per_host})"
    )
    group.add_argument(
        "--host-rate",
        type=float,
        default=d.host_rate,
        metavar="PER_SECOND",
        help="request starts per second per host (default 0: unlimited)",
    )
    group.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=d.connect_timeout,
        metavar="SECONDS",
        help=f"default {d.connect_timeout:g}",
    )
    group.add_argument(
        "--first-byte-timeout",
        type=positive_float,
        default=d.first_byte_timeout,
        metavar="SECONDS",
        help=f"until the response's headers, and between reads of its body (default {d.first_byte_timeout:g})",
    )
    group.add_argument(
        "--deadline",
        type=positive_float,
        default=d.deadline,
        metavar="SECONDS",
        help=f"one URL's whole download: redirects, retries and body; waiting for the host's "
        f"turn does not count (default {d.deadline:g})",
    )
    group.add_argument(
        "--retries",
        type=non_negative_int,
        default=d.retries,
        help=f"retries of connection errors, timeouts, 408, 429 and 5xx (default {d.retries}); "
        "Retry-After is honoured, other 4xx are never retried",
    )


def _execution_arguments(p: argparse.ArgumentParser) -> None:
    run_group = p.add_argument_group("execution")
    run_group.add_argument(
        "--workers",
        type=positive_int,
        default=default_workers(),
        help="decode/validate processes (default: CPUs available); output is the same for any N",
    )
    run_group.add_argument(
        "--num-parts",
        type=positive_int,
        default=1,
        help="split the shards into P parts (one per job-array task); merge afterwards",
    )
    run_group.add_argument(
        "--part",
        type=non_negative_int,
        default=None,
        help="which part this process builds (default: $SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN)",
    )
    run_group.add_argument(
        "--plan-wait",
        type=positive_float,
        default=24 * 3600,
        metavar="SECONDS",
        help="one task of a job lists and plans while the others wait for its plan; give up "
        "waiting after this long (default 86400); a planner that died is taken over",
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def retry_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitforge shard --retry-failed", description=RETRY_DESCRIPTION)
    p.add_argument("dest", help="the folder or store prefix holding a URL-list dataset's dataset.json")
    p.add_argument(
        "--shard-samples",
        type=positive_int,
        default=URL_LIST_SHARD_SAMPLES,
        help=f"at most this many samples per new shard (default {URL_LIST_SHARD_SAMPLES})",
    )
    _timing_arguments(p.add_argument_group("downloading"))
    _execution_arguments(p)
    return p


def subcommand_parser(name: str, help_text: str, workers: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"vitforge shard {name}", description=help_text)
    p.add_argument("dest", help="the folder or s3:// prefix holding dataset.json")
    if workers:
        p.add_argument("--workers", type=positive_int, default=default_workers(), help="shards checked in parallel")
    return p
