"""URL-list sharding against img2dataset 1.47.0, in one run: the same URL list, the same server.

    python benchmarks/url_bench.py [--rows 2000] [--repeat 2] [--concurrency 32] [--work bench-out]
                                   [--skip-competitor] [--keep]

A 2,000-row JSONL list (url, caption) of distinct generated JPEGs (about 500x375, 100 KiB) served
by a local aiohttp server (vitforge.testing.local_images) in a process of its own, so that its CPU
is in neither side's process tree. Both sides download every row at the same concurrency
(img2dataset: 2 processes x concurrency/2 threads; vitforge: --concurrency N --per-host N, its
default of 8 connections per host would otherwise cap a one-host list), downscale so that the
longer side is at most 256 px (img2dataset --resize_mode keep_ratio_largest
--resize_only_if_bigger True; vitforge --max-side 256), re-encode as JPEG quality 95, and write
WebDataset tars of 500 samples (jpg, txt, json). vitforge validates with 2 worker processes.
The rounds alternate the sides (img2dataset, vitforge, img2dataset, ...). Each side is one
command in a fresh process; its CPU is the whole process tree's (the parent's RUSAGE_CHILDREN
around it: the command and every process it started and reaped). images/s is the best round,
CPU-ms per image the mean of the rounds.

What still differs:
- vitforge fully decodes every JPEG strictly (libjpeg warnings are errors) before packing it,
  sniffs the body's format rather than trusting the server, checks robots.txt (one request per
  host) and X-Robots-Tag, records each image's source and output sizes, and packs the shards
  deterministically (the same bytes for any concurrency or worker count, in list order);
  img2dataset decodes with OpenCV (which tolerates corrupt data), honours X-Robots-Tag only,
  and writes samples in the order its threads finish.
- Resize: vitforge Pillow LANCZOS after a DCT-domain draft decode; img2dataset OpenCV INTER_AREA.
  Encode: vitforge 4:4:4 chroma at quality >= 90; OpenCV 4:2:0.
- Outputs: vitforge a DALI index per shard and dataset.json with checksums; img2dataset a
  parquet and a stats file per shard, and each image's EXIF in its json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import describe, run_child  # noqa: E402

IMG2DATASET = "1.47.0"
COMPETITOR_VENV = REPO / ".venv" / "img2dataset"  # git-ignored, as .venv/mlflow-server
SHARD_SAMPLES = 500
MAX_SIDE = 256
QUALITY = 95


def make_images(folder: Path, rows: int) -> None:
    """`rows` distinct JPEGs, about 500x375 (within 10%) and 100 KiB, as FOLDER/NNNNNN.jpg; kept
    for the next run (a stamp says how many)."""
    import numpy as np

    from vitforge.synthetic import class_image, jpeg_bytes

    stamp = folder / f".complete-{rows}"
    if stamp.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for i in range(rows):
        size = (500 + int(rng.integers(-50, 51)), 375 + int(rng.integers(-37, 38)))
        (folder / f"{i:06d}.jpg").write_bytes(jpeg_bytes(class_image(i % 20, 20, rng, size, 22.0), quality=90))
    stamp.touch()


def serve(folder: str) -> int:
    """--serve FOLDER: the image server's process. Prints its port, serves until stdin closes."""
    from vitforge.testing.local_images import start_image_server

    images = {path.name: path.read_bytes() for path in sorted(Path(folder).glob("*.jpg"))}
    server = start_image_server(images)
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()
    return 0


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, __file__, "--serve", str(folder)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    port = process.stdout.readline().strip()
    if not port.isdigit():
        process.kill()
        raise SystemExit(f"the image server did not start (it printed {port!r})")
    return process, f"http://127.0.0.1:{port}"


def write_list(path: Path, names: list[str], base: str) -> None:
    with open(path, "w") as f:
        for i, name in enumerate(names):
            f.write(json.dumps({"url": f"{base}/img/{name}", "caption": f"generated image number {i}"}) + "\n")


def ensure_img2dataset() -> Path:
    """img2dataset in a venv of its own (its pins clash with the project's); installed once."""
    binary = COMPETITOR_VENV / "bin" / "img2dataset"
    python = COMPETITOR_VENV / "bin" / "python"
    if binary.exists():
        found = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('img2dataset'))"],
                               capture_output=True, text=True).stdout.strip()
        if found == IMG2DATASET:
            return binary
    start = time.perf_counter()
    if not python.exists():
        run_child([sys.executable, "-m", "venv", str(COMPETITOR_VENV)])
    run_child([str(COMPETITOR_VENV / "bin" / "pip"), "install", "--quiet", f"img2dataset=={IMG2DATASET}"],
              stdout=subprocess.DEVNULL)
    print(f"installed img2dataset {IMG2DATASET} into {COMPETITOR_VENV} in {time.perf_counter() - start:.0f} s")
    return binary


def vitforge_cmd(url_list: Path, out: Path, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "vitforge", "shard", str(url_list), str(out), "--url-col", "url",
            "--caption-col", "caption", "--no-labels", "--allow-network", "127.0.0.0/8",
            "--concurrency", str(concurrency), "--per-host", str(concurrency), "--workers", "2",
            "--shard-samples", str(SHARD_SAMPLES), "--max-side", str(MAX_SIDE),
            "--format", "jpeg", "--quality", str(QUALITY)]


def img2dataset_cmd(binary: Path, url_list: Path, out: Path, concurrency: int) -> list[str]:
    return [str(binary), "--url_list", str(url_list), "--input_format", "jsonl", "--url_col", "url",
            "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(out),
            "--processes_count", "2", "--thread_count", str(max(1, concurrency // 2)),
            "--image_size", str(MAX_SIDE), "--resize_mode", "keep_ratio_largest", "--resize_only_if_bigger", "True",
            "--encode_format", "jpg", "--encode_quality", str(QUALITY),
            "--number_sample_per_shard", str(SHARD_SAMPLES), "--timeout", "20", "--retries", "3"]


def timed(cmd: list[str], out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process tree) of one command in a fresh process."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": str(REPO)}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run_child(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env=env)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def packed(out: Path) -> tuple[int, Counter]:
    """The images in the tars under OUT, and the longer side of every 100th (both sides resize alike)."""
    count, sizes = 0, Counter()
    for path in sorted(out.glob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name.endswith(".jpg"):
                    if count % 100 == 0:
                        from PIL import Image

                        with Image.open(tar.extractfile(member)) as image:
                            sizes[max(image.size)] += 1
                    count += 1
    return count, sizes


def why_missing(side: str, out: Path) -> str:
    """The failure reasons a side recorded (vitforge's rejects.jsonl, img2dataset's stats files)."""
    reasons: Counter = Counter()
    if side == "vitforge":
        rejects = out / "rejects.jsonl"
        for line in rejects.read_text().splitlines() if rejects.exists() else []:
            reasons[json.loads(line)["reason"]] += 1
    else:
        for path in out.glob("*_stats.json"):
            reasons.update(json.loads(path.read_text()).get("status_dict", {}))
        reasons.pop("success", None)
    return ", ".join(f"{reason} x{n}" for reason, n in reasons.most_common(5)) or "no reason recorded"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32, help="downloads in flight, the same for both sides")
    p.add_argument("--work", default=str(REPO / "bench-out"))
    p.add_argument("--skip-competitor", action="store_true", help="vitforge only (a smoke run): no goal line")
    p.add_argument("--keep", action="store_true", help="leave the last round's outputs under WORK/url-out")
    p.add_argument("--serve", metavar="FOLDER", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args.serve)
    work = Path(args.work)
    images = work / "url-images"
    make_images(images, args.rows)
    names = sorted(path.name for path in images.glob("*.jpg"))[:args.rows]
    mean_kib = sum((images / name).stat().st_size for name in names) / len(names) / 1024
    binary = None if args.skip_competitor else ensure_img2dataset()
    server, base = start_server(images)
    outputs = work / "url-out"
    try:
        url_list = work / "url-list.jsonl"
        write_list(url_list, names, base)
        print(f"url list: {len(names)} rows, distinct JPEGs about 500x375 ({mean_kib:.0f} KiB mean), "
              f"from a local aiohttp server in its own process; concurrency {args.concurrency}, "
              f"longer side <= {MAX_SIDE} px, JPEG quality {QUALITY}, {SHARD_SAMPLES} per shard; "
              f"{os.cpu_count()} CPUs; CPU = whole process tree")
        print("still differs: vitforge strictly decodes every image, sniffs its format, checks robots.txt, "
              "packs deterministically in list order; img2dataset decodes with OpenCV (lenient), "
              "writes in finishing order; Pillow LANCZOS 4:4:4 vs OpenCV INTER_AREA 4:2:0")
        sides = {"vitforge": lambda out: vitforge_cmd(url_list, out, args.concurrency)}
        if binary is not None:
            sides = {f"img2dataset {IMG2DATASET}": lambda out: img2dataset_cmd(binary, url_list, out,
                                                                                args.concurrency), **sides}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        counts: dict[str, int] = {}
        for round_ in range(1, args.repeat + 1):
            for name, make_cmd in sides.items():
                out = outputs / name.split()[0]
                wall, cpu = timed(make_cmd(out), out)
                count, sizes = packed(out)
                results[name].append((wall, cpu))
                counts[name] = min(counts.get(name, count), count)
                shown = ", ".join(f"{side}px x{n}" for side, n in sorted(sizes.items()))
                print(f"round {round_} {name:<18} {wall:7.2f} s {count / wall:7.0f} images/s "
                      f"{1000 * cpu / max(count, 1):6.1f} CPU-ms per image   {count} of {len(names)} images "
                      f"(longer side, 1 in 100: {shown})", flush=True)
                if count != len(names):
                    print(f"  {name} missed {len(names) - count}: {why_missing(name.split()[0], out)}")
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
        rate = {name: counts[name] / min(wall for wall, _ in runs) for name, runs in results.items()}
        cpu_ms = {name: 1000 * sum(cpu for _, cpu in runs) / len(runs) / max(counts[name], 1)
                  for name, runs in results.items()}
        print("success: " + ", ".join(f"{name} {counts[name]} of {len(names)}" for name in sides)
              + ("" if len(set(counts.values())) == 1 else " (NOT EQUAL: see the reasons above)"))
        if binary is not None:
            theirs = f"img2dataset {IMG2DATASET}"
            print(f"vitforge vs img2dataset 1.47, images/s: {rate['vitforge'] / rate[theirs]:.2f}x (goal >= 1.0x)")
            print(f"CPU-ms per image: vitforge {cpu_ms['vitforge']:.1f}, img2dataset {cpu_ms[theirs]:.1f} "
                  f"(for comparison)")
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            print(f"{describe(server.args)} did not stop; killed", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(outputs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
