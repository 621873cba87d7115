"""Object-store egress and requests per epoch as the node count grows: the partitioned order with
the node shard cache against the same cache under one global order (partitions=1), on a real
S3-API server (SeaweedFS on 127.0.0.1).

    python benchmarks/egress_bench.py [--images 2400] [--work bench-out/egress]

Each side runs N "nodes" x 2 ranks for 2 epochs, every rank a thread of this process with the
torch backend; the ranks of a node share a cache folder, nodes do not. Counted by the loaders
themselves (every HTTP request botocore sends, retries included; bytes fetched): the copies of
the dataset fetched per epoch, GETs per 1,000 images, and the cache hit rate. Both sides fetch
whole shards through the same cache and read the same samples; only the order differs. Before
issue 9 the loader sent one ranged GET per sample: 1,000 GETs per 1,000 images at any node count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run(dataset: str, nodes: int, partitions: int | None, cache: str) -> list[dict]:
    from vitforge.pipeline import LoaderSpec, build_loader

    world = 2 * nodes
    spec = LoaderSpec(dataset, batch_size=32, image_size=64, backend="torch", workers=0, partitions=partitions,
                      cache_dir=cache)
    loaders = [build_loader(spec, rank, world, ranks_per_node=2) for rank in range(world)]
    epochs = []
    for _ in range(2):
        before = [dict(loader.reads) for loader in loaders]
        images = [0] * world

        def rank_main(rank):
            images[rank] = sum(len(b["key"]) for b in loaders[rank])

        start = time.perf_counter()
        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reads = {k: sum(loader.reads[k] - b[k] for loader, b in zip(loaders, before)) for k in before[0]}
        epochs.append({**reads, "images": sum(images), "seconds": time.perf_counter() - start})
    return epochs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2400)
    p.add_argument("--shard-samples", type=int, default=100)
    p.add_argument("--work", default="bench-out/egress")
    args = p.parse_args()

    from vitforge.core import open_store
    from vitforge.shards.cli import main as shard_main
    from vitforge.synthetic import write_class_folders
    from vitforge.testing import start_local_s3

    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    write_class_folders(str(work / "images"), num_classes=10, per_class=args.images // 10, realistic=True)
    shard_main([str(work / "images"), str(work / "shards"), "--shard-samples", str(args.shard_samples),
                "--workers", str(len(os.sched_getaffinity(0)))])
    dataset_bytes = sum(f.stat().st_size for f in (work / "shards").glob("*.tar"))
    server = start_local_s3(tempfile.mkdtemp(prefix="egress-s3-"))
    try:
        os.environ.update({**server.env, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret"})
        server.client().create_bucket(Bucket="bench")
        store = open_store("s3://bench/shards")
        for path in sorted(p for p in (work / "shards").iterdir() if p.is_file()):
            store.put_file(str(path), path.name, keep=True)
        print(f"dataset: {args.images} images, {dataset_bytes / 1e6:.1f} MB in "
              f"{len(list((work / 'shards').glob('*.tar')))} shards of {args.shard_samples}; 2 ranks per node")
        for nodes in (1, 2, 4):
            row = {}
            for name, partitions in (("partitioned", None), ("one order", 1)):
                row[name] = run("s3://bench/shards", nodes, partitions, str(work / f"cache-{name[:3]}-{nodes}"))
            for name, epochs in row.items():
                figures = "; ".join(
                    f"epoch {e + 1}: {epoch['bytes'] / dataset_bytes:.2f} copies, "
                    f"{1000 * epoch['requests'] / epoch['images']:.1f} GETs per 1,000 images, hit rate "
                    f"{100 * (1 - epoch['fetches'] / epoch['opens']) if epoch['opens'] else 0:.0f}%"
                    for e, epoch in enumerate(epochs))
                print(f"{nodes} node(s), {name:11s}: {figures}")
            ratio = row["one order"][0]["bytes"] / max(row["partitioned"][0]["bytes"], 1)
            copies = row["partitioned"][0]["bytes"] / dataset_bytes
            print(f"{nodes} node(s): first-epoch egress, one order / partitioned = {ratio:.2f}x (for comparison)")
            print(f"{nodes} node(s): partitioned first-epoch egress {copies:.2f}x the dataset (goal <= 1.05x)")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
