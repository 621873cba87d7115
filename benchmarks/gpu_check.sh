#!/usr/bin/env bash
# The project's one GPU check: a single H200 machine with torch, torchvision, triton and timm but no
# network. At most 8 minutes. Prints every figure; with VITFORGE_GPU_OUT set, also writes them there.
# Small wheels it needs come from benchmarks/wheels/ (git-ignored; `make gpu-wheels` fills it).
# Sections are added by the issues that have a GPU goal:
#   loader (issues 3, 9): GPU JPEG decode feeding 224 px batches (torchvision nvJPEG as the DALI stand-in);
#     the data wait of a consumer 1.5x slower than our torch backend on the GPU (issue 9)
#   trainer (issue 4): ViT-H/14 bf16 ZeRO-2 on one GPU, largest micro-batch: images/s, MFU, peak memory
#   collectives (issue 18): a tiny ViT under NCCL for more than log_every steps with one evaluation,
#     then fine-tuned from and evaluated (weights broadcast tensor by tensor); each stage ok or why not
#   end to end (issue 11): ViT-H/14 bf16 ZeRO-2 from JPEG shards through the real loader (torch backend,
#     pinned side-stream copies), eager and with model.compile: images/s, data wait, MFU
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${VITFORGE_GPU_OUT:-}"
[ -n "$OUT" ] && mkdir -p "$OUT"

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.version.cuda)"

echo "== wheels"
if [ -d benchmarks/wheels ]; then
    python -m pip install --quiet --no-index --find-links benchmarks/wheels simplejpeg fsspec braceexpand psutil \
        webdataset pyyaml pydantic 2>&1 | tail -3
    # DeepSpeed ships as an sdist only: a pure-Python build against the machine's torch.
    python -c "import deepspeed" 2>/dev/null || python -m pip install --quiet --no-index --no-build-isolation \
        --find-links benchmarks/wheels deepspeed==0.19.8 2>&1 | tail -3
else
    echo "benchmarks/wheels missing: run 'make gpu-wheels' on a machine with network, then carry it"
fi

status=0
# Budget (8 minutes in all): loader 70 s, trainer 105 s, collectives 75 s (its stages print as they
# finish: train with a log step and an eval first), end to end 230 s.
echo "== loader (issue 3)"
timeout 70 python benchmarks/gpu_loader_check.py --device cuda --images 3000 ${OUT:+--out "$OUT"} || status=1

echo "== trainer (issue 4)"
timeout 105 python benchmarks/gpu_train_check.py --candidates 192,128 --steps 20 ${OUT:+--out "$OUT"} || status=1

echo "== collectives (issue 18)"
timeout 75 python benchmarks/gpu_train_check.py --collectives ${OUT:+--out "$OUT"} || status=1

echo "== end to end (issue 11)"
timeout 230 python benchmarks/gpu_e2e_check.py --images 1536 --steps 30 --timeout 100 ${OUT:+--out "$OUT"} || status=1
exit $status
