"""`vitforge demo`'s run and its stages but training (demo_train.py): the corpus, the object store,
sharding, evaluation, export and the paper's figures. Each stage is `vitforge` commands, printed
before they run (`Demo.vitforge`); the facts they gather make the report (demo_report.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from vitforge.core import open_store

from .synthetic import write_broken_files, write_class_folders

BUCKET = "vitforge-demo"


@dataclass
class Demo:
    out: str
    images: int
    val_images: int
    steps: int
    workers: int
    store: str  # auto | local
    launcher: str  # auto | slurm | direct
    classes: int = 10
    facts: dict = field(default_factory=dict)  # what the report says
    stage: int = 0

    def path(self, *parts: str) -> str:
        return os.path.abspath(os.path.join(self.out, *parts))

    def say(self, title: str) -> None:
        self.stage += 1
        print(f"\n== [{self.stage}/8] {title}", flush=True)

    def vitforge(self, *args: str, quiet: bool = False, echo: bool = True) -> subprocess.CompletedProcess:
        """Run one vitforge command as a user would, echoing it (and its output unless `quiet`)."""
        if echo:
            print("$ vitforge " + shlex.join(args), flush=True)
        result = subprocess.run([sys.executable, "-m", "vitforge", *args], capture_output=True, text=True)
        if not quiet and result.stdout.strip():
            print(result.stdout.rstrip(), flush=True)
        if result.returncode != 0:
            raise DemoError(
                f"`vitforge {args[0]}` failed with exit code {result.returncode}:\n{result.stderr[-3000:]}",
                result.returncode,
            )
        return result


class DemoError(Exception):
    """A stage failed: a command's exit code, or 1 when one of the demo's own checks did not hold."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def make_corpus(demo: Demo) -> None:
    demo.say(f"generate {demo.images} training and {demo.val_images} held-out JPEGs in {demo.classes} classes")
    train, val = demo.path("corpus", "train"), demo.path("corpus", "val")
    paths = write_class_folders(train, demo.classes, demo.images // demo.classes, seed=0, varied=True)
    write_class_folders(val, demo.classes, demo.val_images // demo.classes, seed=1, varied=True)
    broken = write_broken_files(train)
    print(
        f"{len(paths)} images of 48-256 px at aspect ratios 1:2 to 2:1 under {train}, and {len(broken)} broken "
        f"files the sharder must reject: " + ", ".join(f"{os.path.basename(p)} ({r})" for p, r in broken.items())
    )
    demo.facts.update(corpus=train, val_corpus=val, broken=broken, images=len(paths))


def start_store(demo: Demo):
    """The datasets' and checkpoints' home: s3://vitforge-demo on a private server, or a folder."""
    # The stand-ins are imported where used: only `vitforge demo` needs them, not the rest of the CLI.
    from vitforge.testing import start_local_s3

    demo.say("start an object store on 127.0.0.1")
    if demo.store == "auto":
        try:
            server = start_local_s3(demo.path("store"))
            server.client().create_bucket(Bucket=BUCKET)
            os.environ.update(server.env)  # every command below, and this process, reach the store
            demo.facts.update(store=f"s3://{BUCKET}", endpoint=server.endpoint, store_data=demo.path("store"))
            print(
                f"SeaweedFS S3 API at {server.endpoint} (data in {demo.path('store')}); "
                "the AWS_* variables of every command below point at it"
            )
            return server.stop
        except Exception as e:  # any reason it cannot start: say it and go on with a folder
            print(f"the S3 server did not start ({str(e).splitlines()[0]}); using a local folder instead")
            demo.facts["store_fallback"] = str(e).splitlines()[0]
    demo.facts.update(store=demo.path("bucket"))
    print(f"storing datasets and checkpoints in {demo.facts['store']}")
    return None


def shard(demo: Demo) -> None:
    demo.say("shard the corpus into the store and verify every shard")
    train, val = f"{demo.facts['store']}/shards/train", f"{demo.facts['store']}/shards/val"
    per_shard = str(max(demo.images // 8, 50))
    result = demo.vitforge(
        "shard", demo.facts["corpus"], train, "--shard-samples", per_shard, "--workers", str(demo.workers)
    )
    demo.vitforge(
        "shard",
        demo.facts["val_corpus"],
        val,
        "--prefix",
        "val",
        "--classes",
        f"{train}/dataset.json",
        "--workers",
        str(demo.workers),
    )
    verified = demo.vitforge("shard", "verify", train, "--workers", str(demo.workers))
    # The same command into a folder gives the same bytes (sharding is deterministic); the copy
    # stays for the README's next steps (`vitforge train tiny_cpu` reads demo-out/shards).
    local = demo.path("shards")
    demo.vitforge(
        "shard", demo.facts["corpus"], local, "--shard-samples", per_shard, "--workers", str(demo.workers), quiet=True
    )
    if _shard_digests(local) != _shard_digests(train):
        raise DemoError(f"{local} and {train} hold different shards from the same command")
    print(f"the same command into {local}: the same bytes, shard for shard (kept for the README's next steps)")
    info = demo.vitforge("shard", "info", train, quiet=True).stdout
    rejects = open_store(train).get_bytes("rejects.jsonl").decode().splitlines()
    demo.facts.update(
        train=train,
        val=val,
        local_shards=local,
        shard_summary=result.stdout.strip(),
        shard_info=info.strip(),
        verify=verified.stdout.strip().splitlines()[-1],
        rejects=[json.loads(r) for r in rejects],
    )


def _shard_digests(dataset: str) -> list[str]:
    return [s["sha256"] for s in json.loads(open_store(dataset).get_bytes("dataset.json"))["shards"]]


def evaluate(demo: Demo) -> None:
    demo.say("evaluate the trained model on the held-out shards")
    result = demo.vitforge(
        "eval",
        "tiny_cpu",
        "--checkpoint",
        demo.facts["run"],
        "--set",
        f"data.val={demo.facts['val']}",
        "--set",
        "data.backend=dali-cpu",
        quiet=True,
    )
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        f"held-out top-1 {100 * metrics['eval_top1']:.1f}% (chance {100 / demo.classes:.0f}%), top-5 "
        f"{100 * metrics['eval_top5']:.1f}%, loss {metrics['eval_loss']:.3f} over {metrics['eval_samples']} images"
    )
    demo.facts["eval"] = metrics


def export(demo: Demo) -> None:
    demo.say("export the weights to safetensors and reload them in timm")
    weights = demo.path("model.safetensors")
    exported = json.loads(
        demo.vitforge("ckpt", "export", demo.facts["run"], "--out", weights, quiet=True).stdout.strip().splitlines()[-1]
    )
    print(
        f"{weights}: {exported['model']} at {exported['image_size']} px, {exported['num_classes']} classes, "
        f"from {exported['source']}"
    )
    check = _timm_top1(weights, demo.facts["val"])
    print(
        f"timm's VisionTransformer loaded {weights} strictly: held-out top-1 {100 * check['top1']:.1f}% over "
        f"{check['samples']} images (the torch loader's decode; eval above used DALI's)"
    )
    demo.facts.update(weights=weights, timm=check)


def _timm_top1(weights: str, val: str) -> dict:
    """Rebuild the model with timm alone from the export's description, load the weights strictly,
    and classify the held-out shards with it."""
    import timm
    import torch
    from safetensors.torch import load_file
    from timm.models.vision_transformer import VisionTransformer

    from vitforge.pipeline import IGNORE_LABEL, LoaderSpec, build_loader
    from vitforge.trainer import TINY_MODELS

    with open(weights.removesuffix(".safetensors") + ".json") as f:
        description = json.load(f)
    name, size, classes = description["model"], description["image_size"], description["num_classes"]
    if name in TINY_MODELS:  # a CPU-sized layout of timm's VisionTransformer, not in timm's registry
        model = VisionTransformer(img_size=size, num_classes=classes, **TINY_MODELS[name])
    else:
        model = timm.create_model(name, img_size=size, num_classes=classes)
    model.load_state_dict(load_file(weights), strict=True)
    model.eval()
    hits = count = 0
    with torch.no_grad():
        for batch in build_loader(
            LoaderSpec(val, batch_size=100, image_size=size, train=False, backend="torch", workers=0)
        ):
            real = batch["label"] != IGNORE_LABEL
            predicted = model(batch["image"].float()).argmax(dim=1)
            hits += int((predicted == batch["label"])[real].sum())
            count += int(real.sum())
    return {"model": name, "top1": hits / max(count, 1), "samples": count}


def draw_figures(demo: Demo) -> None:
    demo.say("draw the ViT paper's figures for the trained model")
    result = demo.vitforge(
        "inspect",
        demo.facts["run"],
        "--images",
        demo.facts["val"],
        "--count",
        "8",
        "--out",
        demo.path("figures"),
        quiet=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"wrote {len(summary['files'])} files under {demo.path('figures')}")
    demo.facts["figures"] = summary
