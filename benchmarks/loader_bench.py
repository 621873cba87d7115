"""Loader throughput on realistic JPEGs, ours against a plain baseline and a decode-only floor.

    python benchmarks/loader_bench.py [--images 4000] [--work bench-out]

Each configuration runs in its own process; CPU time counts that process and its workers. Prints
images/s and images per CPU-second for: the DALI CPU backend, the torch backend, a plain baseline
(webdataset + Pillow + torchvision RandomResizedCrop in a DataLoader), and the decode-only floor
(libjpeg-turbo decode of every image, nothing else). Goals: best CPU backend >= 1.5x the baseline per
CPU-second, and within 2.5x of the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUNNER = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
kind, shards, batch, steps, workers = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])

from vitforge.pipeline.cli import cpu_seconds as cpu

if kind in ("dali-cpu", "torch"):
    from vitforge.pipeline import LoaderSpec
    from vitforge.pipeline.cli import measure
    result = measure(LoaderSpec(shards, batch_size=batch, image_size=224, backend=kind, workers=workers), steps, 5, "cpu")
elif kind == "baseline":
    import glob, torch, webdataset as wds
    from torchvision import transforms as T
    transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    urls = sorted(glob.glob(os.path.join(shards, "*.tar")))
    dataset = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node).shuffle(1000)
               .decode("pil").to_tuple("jpg", "cls").map_tuple(transform, lambda c: c).batched(batch))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers).repeat()
    done = 0
    for images, labels in loader:
        done += 1
        if done == 5:
            start, cpu0 = time.perf_counter(), cpu()
        if done == 5 + steps:
            break
    elapsed = time.perf_counter() - start
    del loader
    import gc; gc.collect()
    spent = cpu() - cpu0
    result = {"images_per_s": steps * batch / elapsed, "images_per_cpu_s": steps * batch / spent}
else:  # decode-only floor
    import glob, tarfile, simplejpeg
    datas = []
    for url in sorted(glob.glob(os.path.join(shards, "*.tar"))):
        with tarfile.open(url) as tar:
            datas += [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]
    datas = datas[: steps * batch]
    start, cpu0 = time.perf_counter(), cpu()
    for data in datas:
        simplejpeg.decode_jpeg(data)
    elapsed, spent = time.perf_counter() - start, cpu() - cpu0
    result = {"images_per_s": len(datas) / elapsed, "images_per_cpu_s": len(datas) / spent}
print(json.dumps(result))
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--work", default=str(REPO / "bench-out"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args()
    from benchmarks.shard_bench import make_corpus

    work = Path(args.work)
    make_corpus(work / "corpus", args.images)
    shards = work / "loader-shards"
    if not (shards / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "vitforge", "shard", str(work / "corpus"), str(shards),
                        "--shard-bytes", "64MiB"], check=True, cwd=REPO, capture_output=True)
    print(f"corpus: {args.images} JPEGs about 500x375 (106 KiB), batch {args.batch} x {args.steps} steps "
          f"at 224 px, {args.workers} workers, {os.cpu_count()} CPUs")
    results = {}
    for kind, label in [("dali-cpu", "vitforge dali-cpu"), ("torch", "vitforge torch"),
                        ("baseline", "baseline webdataset+Pillow+RRC"), ("floor", "decode-only floor (simplejpeg)")]:
        out = subprocess.run([sys.executable, "-c", RUNNER, str(REPO), kind, str(shards), str(args.batch),
                              str(args.steps), str(args.workers)], check=True, cwd=REPO, capture_output=True, text=True)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{label:<36} {results[kind]['images_per_s']:8.0f} images/s {results[kind]['images_per_cpu_s']:8.0f} "
              f"images per CPU-second")
    best = max(("dali-cpu", "torch"), key=lambda k: results[k]["images_per_cpu_s"])
    per_cpu = {k: v["images_per_cpu_s"] for k, v in results.items()}
    print(f"best CPU backend ({best}) vs baseline, per CPU-second: {per_cpu[best] / per_cpu['baseline']:.2f}x "
          f"(goal >= 1.5x)")
    print(f"decode-only floor vs best CPU backend, per CPU-second: {per_cpu['floor'] / per_cpu[best]:.2f}x "
          f"(goal <= 2.5x)")
    print(f"images/s: dali-cpu {results['dali-cpu']['images_per_s'] / results['baseline']['images_per_s']:.2f}x, "
          f"torch {results['torch']['images_per_s'] / results['baseline']['images_per_s']:.2f}x the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
