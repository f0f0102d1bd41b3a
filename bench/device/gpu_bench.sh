#!/usr/bin/env bash
# The GPU throughput benchmark (issue 8) in one call of the lent machine (under its 600 s limit); nothing to carry:
#   bash bench/device/gpu_bench.sh            -> $OUT/gpu.json and the table
# Qwen3-4B runs without recomputation at 8 sequences per pass (16 x 512 does not fit in 80 GB without it). Plain
# generate runs twice: its first run on a fresh machine varied 1.6x between machines (docs/benchmarks.md).
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 bench/gpu.py --json "${OUT:-/tmp}/gpu.json" --budget-s "${BUDGET_S:-500}" \
  --rollout plain:256,plain:256,static:256,static:768 --train lm+ckpt,grpo:8,grpo+compile:8 \
  --small-arch-rollout plain:256,static:256,static:1024 "$@" 2>&1 | grep -v -i "warn" | tail -40
