"""The demo's report: DEMO/report.md with a summary table, training curves and throughput as PNG
plots, the shard report, and where every output is; DEMO/summary.json with its numbers."""

from __future__ import annotations

import json
import os
import re
import statistics
from collections import Counter


def write_report(out: str, facts: dict) -> str:
    metrics = facts["metrics"]
    plots = _plots(out, metrics, facts["stop_step"])
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_top1" in m]
    steady = [m["images_per_s"] for m in train[1:]] or [m["images_per_s"] for m in train]
    packed = re.search(r"= (\d+) packed", facts["shard_summary"]).group(1)
    lines = _markdown(facts, _summary_rows(facts, train, steady, packed), _where(out, facts, plots), plots, evals)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    summary = _summary(out, facts, train, steady, packed, path, plots)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return path


def _summary_rows(facts: dict, train: list[dict], steady: list[float], packed: str) -> list[tuple[str, str]]:
    """The report's summary table: accuracy, training, preemption, launcher, throughput, data."""
    ev, timm = facts["eval"], facts["timm"]
    launcher = (
        f"a private local SLURM: job {facts['job']}, requeued {facts['requeues']} time(s) by its own script"
        if facts["launcher"] == "slurm"
        else f"2 rank processes started directly ({facts['launcher_why'] or 'asked'}), relaunched after exit 75"
    )
    by_reason = ", ".join(f"{k} {v}" for k, v in sorted(Counter(r["reason"] for r in facts["rejects"]).items()))
    return [
        (
            "held-out top-1 (`vitforge eval`)",
            f"{100 * ev['eval_top1']:.1f}% over {ev['eval_samples']} images "
            f"(chance 10%); top-5 {100 * ev['eval_top5']:.1f}%",
        ),
        ("held-out top-1, weights reloaded in timm", f"{100 * timm['top1']:.1f}% over {timm['samples']} images"),
        (
            "training",
            f"{train[-1]['step'] if train else 0} steps of 32 images, tiny ViT (`vit_tiny_cpu`), ZeRO-2, "
            "2 CPU processes (gloo), DALI CPU loader reading from the store",
        ),
        ("final training loss", f"{train[-1]['loss']:.3f} (first logged {train[0]['loss']:.3f})" if train else "-"),
        (
            "preemption",
            f"stopped at step {facts['stop_step']} ({facts['stop_reason']}) after saving a complete "
            f"checkpoint; resumed from {facts['resumed_from']} at step {facts['resume_step']}",
        ),
        ("launcher", launcher),
        (
            "throughput",
            f"median {statistics.median(steady):.0f} images/s over the run's log windows, "
            f"data wait median {100 * statistics.median(m['data_wait_fraction'] for m in train):.0f}%",
        ),
        (
            "data",
            f"{facts['images']} generated images and {len(facts['broken'])} broken files: "
            f"{packed} packed, {len(facts['rejects'])} rejected ({by_reason})",
        ),
        ("verify", facts["verify"]),
        ("wall time", f"{facts['minutes']:.1f} minutes"),
    ]


def _where(out: str, facts: dict, plots: list[str]) -> list[tuple[str, str]]:
    """Where every output of the demo is."""
    store = facts["store"] + (
        f" (SeaweedFS at {facts['endpoint']})"
        if "endpoint" in facts
        else f" (a local folder: {facts.get('store_fallback', 'asked for')})"
    )
    return [
        ("object store", store),
        ("training shards", f"{facts['train']}, and byte for byte the same in {facts['local_shards']}"),
        ("held-out shards", facts["val"]),
        ("checkpoints", f"{facts['run']} (`vitforge ckpt list {facts['run']}`)"),
        ("metrics", os.path.join(out, "logs", "metrics.jsonl") + " (and TensorBoard events beside it)"),
        ("training logs", ", ".join(facts["train_logs"])),
        ("exported weights", f"{facts['weights']} and its .json description"),
        ("the paper's figures", os.path.join(out, "figures")),
        ("plots", ", ".join(os.path.join(out, p) for p in plots)),
        ("generated corpus", f"{facts['corpus']} (held-out: {facts['val_corpus']})"),
    ]


def _markdown(
    facts: dict, rows: list[tuple[str, str]], where: list[tuple[str, str]], plots: list[str], evals: list[dict]
) -> list[str]:
    """report.md's lines: the summary, the training curves, the shards, the figures, where everything is."""
    lines = ["# vitforge demo report", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "## Training", ""]
    lines += [f"![{p}]({p})" for p in plots]
    lines += [
        "",
        "Held-out top-1 during training: " + ", ".join(f"step {m['step']}: {100 * m['eval_top1']:.1f}%" for m in evals),
    ]
    lines += [
        "",
        "## Shards",
        "",
        "```",
        facts["shard_summary"],
        "",
        facts["shard_info"],
        "```",
        "",
        "Rejected files (`rejects.jsonl`):",
        "",
        "| file | reason | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {r['source']} | {r['reason']} | {r['detail']} |" for r in facts["rejects"]]
    lines += ["", "## The paper's figures", ""]
    lines += [
        f"![{os.path.basename(p)}](figures/{os.path.basename(p)})"
        for p in facts["figures"]["files"]
        if p.endswith(".png")
    ]
    lines += ["", "## Where everything is", "", "| what | where |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in where]
    if "endpoint" in facts:
        lines += [
            "",
            f"The store was stopped with the demo; its data stays in {facts['store_data']}. To browse it "
            f"again: `weed mini -dir={facts['store_data']}` (its S3 port is printed), or rerun the demo.",
        ]
    return lines


def _summary(
    out: str, facts: dict, train: list[dict], steady: list[float], packed: str, path: str, plots: list[str]
) -> dict:
    """summary.json: the report's numbers and files."""
    ev, timm = facts["eval"], facts["timm"]
    return {
        "eval": ev,
        "timm": timm,
        "packed": int(packed),
        "rejects": facts["rejects"],
        "launcher": facts["launcher"],
        "stop_step": facts["stop_step"],
        "stop_reason": facts["stop_reason"],
        "resumed_from": facts["resumed_from"],
        "resume_step": facts["resume_step"],
        "steps": train[-1]["step"] if train else 0,
        "median_images_per_s": statistics.median(steady),
        "minutes": facts["minutes"],
        "store": facts["store"],
        "run": facts["run"],
        "files": {
            "report": path,
            "plots": [os.path.join(out, p) for p in plots],
            "weights": facts["weights"],
            "figures": facts["figures"]["files"],
        },
    }


def _plots(out: str, metrics: list[dict], stop_step: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_top1" in m]
    drawn = []
    for name, rows, key, label, scale in (
        ("loss.png", train, "loss", "training loss", 1),
        ("accuracy.png", evals, "eval_top1", "held-out top-1 (%)", 100),
        ("throughput.png", train, "images_per_s", "images/s (2 CPU ranks)", 1),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        ax.plot([m["step"] for m in rows], [scale * m[key] for m in rows], marker="o", markersize=3)
        ax.axvline(stop_step, color="tab:red", linestyle="--", label=f"SIGUSR1, resumed at step {stop_step}")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, name))
        plt.close(fig)
        drawn.append(name)
    return drawn
