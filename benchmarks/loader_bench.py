"""Loader throughput on realistic JPEGs, ours against a plain baseline and a decode-only floor,
and the data wait of a training-shaped consumer.

    python benchmarks/loader_bench.py [--images 4000] [--work bench-out]

Every side is counted the same way. Each run is its own process; its CPU is the whole process
tree's (the parent's RUSAGE_CHILDREN around it: the process, its threads, and every worker it
started and reaped). A steady-state figure is the difference between a long and a short run of the
same side (`--long` and `--short` batches): start-up, imports, worker forks and the first
prefetch cancel out, and so does whatever was prefetched but never consumed at the end.

Sides, each doing the same work per image (decode a JPEG, crop a random-resized-crop window,
resize it to 224 px with an antialiased bilinear filter, maybe flip, normalise to float32 NCHW
with the ImageNet mean and std, hand the batch to the consuming process):
- dali-cpu: DALI's region-of-interest JPEG decode, resize and crop-mirror-normalise in its own
  threads (in line with the consumer here, the CPU-device default);
- torch: our DataLoader workers decode (libjpeg-turbo via simplejpeg, at a reduced DCT scale of
  1/2 or below when the crop allows), crop and resize (torch's antialiased bilinear for windows on
  whole pixels, Pillow's otherwise) into the uint8 batch; the batch crosses to the
  consumer as uint8 and the consumer's process normalises it (a read-ahead thread), as the
  device does on a GPU: that cost is inside the measured process tree;
- baseline: webdataset + Pillow decode + torchvision RandomResizedCrop/flip/ToTensor/Normalize
  in a DataLoader, float batches to the consumer;
- floor: simplejpeg's full decode of each image, nothing else (no crop, resize, normalise or
  inter-process copy): what decoding alone costs.
What still differs: the baseline reads tars with webdataset and shuffles with its buffer, ours
read by index in the epoch's order; our crop windows come from a hash, torchvision's from its RNG
(the same distribution); the floor decodes every image whole and at full scale.
Then a consumer that sleeps per batch (the step) for 1.5x the time the side itself needs per batch,
so the loader is faster than the step: the fraction of the consumer's time spent waiting for data,
over all batches after the fifth. The sleep stands in for a GPU step, so DALI runs overlapped
there, as it does by default on a GPU; the throughput lines use the CPU-device default (DALI in
line).
Goals: best CPU backend >= 2.0x the baseline per CPU-second (first bar 1.5x); the floor within
1.4x of the best backend; data wait <= 5% when the loader outpaces the consumer.
A mixture row: the torch backend over 3 sources at 0.6/0.3/0.1 (the same shards under 3 names,
so the work per image is the single source's), against the single source per CPU-second (goal
>= 0.95x: the interleave costs nothing measurable). What differs: the mixture's 3 loaders split
the workers by weight, at least one each (3 worker processes where the single source has
--workers).
With --s3, the torch backend also reads the shards from an S3 server on loopback (s3_sides): a
shard the node cache has no room for, streamed in coalesced ranged GETs, >= 0.5x the images/s of
cached reads; one GET per sample printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import FORK_HELP, preload, run_child  # noqa: E402

# What the sides import: with --fork, imported once by the benchmark's own process.
SIDE_MODULES = ("torch", "torchvision", "webdataset", "simplejpeg", "nvidia.dali", "vitforge.pipeline.loader",
                "vitforge.pipeline.torch_backend", "vitforge.pipeline.dali_backend")

RUNNER = r'''
import json, os, sys, time
kind, shards, batch, steps, workers, step_s = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                               int(sys.argv[5]), float(sys.argv[6]))
cache = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}  # --s3: the node cache's settings


def baseline():
    import glob, torch, webdataset as wds
    from torchvision import transforms as T
    transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    urls = sorted(glob.glob(os.path.join(shards, "*.tar")))
    dataset = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node).shuffle(1000)
               .decode("pil").to_tuple("jpg", "cls").map_tuple(transform, lambda c: c).batched(batch))
    return iter(wds.WebLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=2).repeat())


def ours():
    from vitforge.pipeline import LoaderSpec, MixtureSource, build_loader, build_mixture_loader, stream
    if "stream_ahead" in cache:  # 0: every streamed read one GET of its own, as before coalescing
        stream.AHEAD_BYTES = cache.pop("stream_ahead")
    mixture = cache.pop("mixture", None)  # [[url, weight], ...]: the sources of a mixture
    # With a consumer, its sleep stands in for a GPU step, so DALI overlaps as it does on a GPU node
    # (on a CPU device it decodes in line by default: the step would need the same cores).
    spec = LoaderSpec(shards, batch_size=batch, image_size=224, backend=kind, workers=workers,
                      overlap=True if step_s else None, **cache)
    loader = (build_mixture_loader(spec, [MixtureSource(url=u, weight=w) for u, w in mixture]) if mixture
              else build_loader(spec))
    while True:
        yield from loader


def floor():
    import glob, tarfile, simplejpeg
    datas = []
    for url in sorted(glob.glob(os.path.join(shards, "*.tar"))):
        with tarfile.open(url) as tar:
            datas += [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]
    while True:
        for i in range(0, len(datas) - batch + 1, batch):
            yield [simplejpeg.decode_jpeg(d) for d in datas[i:i + batch]]


batches = {"baseline": baseline, "floor": floor}.get(kind, ours)()
waited, timed_from = 0.0, None
for done in range(steps):
    asked = time.perf_counter()
    next(batches)
    if done == 5:
        timed_from, waited = asked, 0.0
    waited += time.perf_counter() - asked
    time.sleep(step_s)
wait = waited / (time.perf_counter() - timed_from) if timed_from else None
print(json.dumps({"wait_fraction": wait}))
# Workers must be joined (reaped), or their CPU never reaches the parent's RUSAGE_CHILDREN.
getattr(batches, "close", lambda: None)()
del batches
import gc; gc.collect()
'''


def run_side(kind: str, shards: Path | str, batch: int, steps: int, workers: int, step_s: float = 0.0,
             cache: dict | None = None, env: dict | None = None, fork: bool = False) -> dict:
    """One process: wall seconds, CPU seconds of its whole tree, and the consumer's wait fraction."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = run_child([sys.executable, "-c", RUNNER, kind, str(shards), str(batch), str(steps), str(workers),
                     str(step_s), json.dumps(cache or {})], cwd=REPO,
                    env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}, fork=fork)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"wall": wall, "cpu": cpu, **json.loads(out.stdout.strip().splitlines()[-1])}


def steady_rates(kind: str, shards: Path | str, args, **side) -> dict:
    """images/s and images per CPU-second of a side between its short and its long run."""
    short = run_side(kind, shards, args.batch, args.short, args.workers, fork=args.fork, **side)
    long = run_side(kind, shards, args.batch, args.long, args.workers, fork=args.fork, **side)
    images = (args.long - args.short) * args.batch
    return {"images_per_s": images / (long["wall"] - short["wall"]),
            "images_per_cpu_s": images / (long["cpu"] - short["cpu"])}


def s3_sides(shards: Path, work: Path, args) -> None:
    """--s3: the torch backend reading the shards from an S3 server on loopback (SeaweedFS),
    through the node cache (each shard fetched whole in ranged GETs of 16 MiB, then read from
    disk), streamed (a cache smaller than one shard: samples read ahead in coalesced ranged GETs),
    and streamed one GET per sample (what streaming did before). Each run has an empty cache; the
    server's CPU is outside every side's process tree alike."""
    import uuid

    from vitforge.testing import start_local_s3

    for leftover in ("s3", "cache"):  # an earlier run's bucket and cached shards
        shutil.rmtree(work / leftover, ignore_errors=True)
    server = start_local_s3(str(work / "s3"))
    try:
        client, bucket = server.client(), "loader-bench"
        client.create_bucket(Bucket=bucket)
        for path in sorted(shards.iterdir()):
            if path.is_file():
                client.upload_file(str(path), bucket, f"shards/{path.name}")
        url = f"s3://{bucket}/shards"
        small = 1 / 1024  # GB: 1 MiB, below one shard

        def cache(gb: float, **extra) -> dict:
            return {"cache_gb": gb, "cache_dir": str(work / "cache" / uuid.uuid4().hex), **extra}

        sides = {"cached": cache(32.0), "streamed": cache(small), "per-sample": cache(small, stream_ahead=0)}
        rates = {}
        for name, settings in sides.items():
            rates[name] = steady_rates("torch", url, args, cache=settings, env=server.env)
            print(f"s3 torch {name:<11} {rates[name]['images_per_s']:8.0f} images/s "
                  f"{rates[name]['images_per_cpu_s']:8.0f} images per CPU-second")
        cached = rates["cached"]["images_per_s"]
        print(f"s3 streamed vs cached, images/s: {rates['streamed']['images_per_s'] / cached:.2f}x (goal >= 0.5x); "
              f"one GET per sample: {rates['per-sample']['images_per_s'] / cached:.2f}x (for comparison)")
    finally:
        server.stop()


def mixture_rates(shards: Path, work: Path, args) -> dict:
    """steady_rates of the torch backend over 3 sources at 0.6/0.3/0.1: the shards under 3 names."""
    sources = []
    for name, weight in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
        link = work / f"mixture-{name}"
        if not link.exists():
            link.symlink_to(shards.resolve(), target_is_directory=True)
        sources.append([str(link), weight])
    return steady_rates("torch", shards, args, cache={"mixture": sources})


def loader_corpus(work: Path, images: int, fork: bool = False) -> Path:
    """The sharded corpus (4,000 JPEGs about 500x375 in 20 classes by default), made once."""
    from benchmarks.shard_bench import make_corpus

    shards = work / "loader-shards"
    if not (shards / "dataset.json").exists():
        make_corpus(work / "corpus", images)
        run_child([sys.executable, "-m", "vitforge", "shard", str(work / "corpus"), str(shards),
                   "--shard-bytes", "64MiB"], cwd=REPO, fork=fork)
    return shards


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--work", default=str(REPO / "bench-out"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--short", type=int, default=10, help="batches of the short run")
    p.add_argument("--long", type=int, default=90, help="batches of the long run")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--s3", action="store_true", help="also read the shards from an S3 server on loopback: "
                   "cached, streamed in coalesced ranged GETs, and one GET per sample")
    p.add_argument("--consumer-batches", type=int, default=40,
                   help="batches of each consumer run (its wait counts those after the fifth)")
    p.add_argument("--fork", action="store_true", help=FORK_HELP)
    args = p.parse_args()
    if args.fork:
        preload(*SIDE_MODULES)
    work = Path(args.work)
    shards = loader_corpus(work, args.images, args.fork)
    print(f"corpus: {args.images} JPEGs about 500x375 (106 KiB), batch {args.batch}, steady state = "
          f"{args.long} - {args.short} batches at 224 px, {args.workers} workers, {os.cpu_count()} CPUs; "
          "CPU = whole process tree")
    sides = [("dali-cpu", "vitforge dali-cpu"), ("torch", "vitforge torch"),
             ("baseline", "baseline webdataset+Pillow+RRC"), ("floor", "decode-only floor (simplejpeg)")]
    rates = {}
    for kind, label in sides:
        rates[kind] = steady_rates(kind, shards, args)
        print(f"{label:<36} {rates[kind]['images_per_s']:8.0f} images/s {rates[kind]['images_per_cpu_s']:8.0f} "
              f"images per CPU-second")
    per_cpu = {k: v["images_per_cpu_s"] for k, v in rates.items()}
    best = max(("dali-cpu", "torch"), key=per_cpu.get)
    print(f"best CPU backend ({best}) vs baseline, per CPU-second: {per_cpu[best] / per_cpu['baseline']:.2f}x "
          "(goal >= 2.0x (first bar 1.5x))")
    print(f"decode-only floor vs best CPU backend, per CPU-second: {per_cpu['floor'] / per_cpu[best]:.2f}x "
          "(goal <= 1.4x)")
    rates["mixture"] = mixture_rates(shards, work, args)
    print(f"{'vitforge torch, mixture 0.6/0.3/0.1':<36} {rates['mixture']['images_per_s']:8.0f} images/s "
          f"{rates['mixture']['images_per_cpu_s']:8.0f} images per CPU-second")
    print(f"mixture of 3 vs one source (torch), per CPU-second: "
          f"{rates['mixture']['images_per_cpu_s'] / per_cpu['torch']:.2f}x, images/s: "
          f"{rates['mixture']['images_per_s'] / rates['torch']['images_per_s']:.2f}x (goal >= 0.95x per CPU-second)")
    print(f"images/s: dali-cpu {rates['dali-cpu']['images_per_s'] / rates['baseline']['images_per_s']:.2f}x, "
          f"torch {rates['torch']['images_per_s'] / rates['baseline']['images_per_s']:.2f}x the baseline "
          "(for comparison)")
    for kind, label in sides[:3]:
        # A smoke-sized run's few extra batches can cost less than its start-up noise, so its steady
        # rate can come out negative: the consumer then does not sleep at all.
        step_s = max(0.0, 1.5 * args.batch / rates[kind]["images_per_s"])
        wait = run_side(kind, shards, args.batch, args.consumer_batches, args.workers, step_s,
                        fork=args.fork)["wait_fraction"]
        goal = "for comparison" if kind == "baseline" else "goal <= 5%"
        print(f"consumer at {1000 * step_s:.0f} ms per batch (1.5x {label}'s own time): data wait "
              f"{100 * wait:.1f}% ({goal})")
    if args.s3:
        s3_sides(shards, work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
