#!/usr/bin/env bash
# Call 3 of the proof-of-learning run on the lent GPU: GRPO from the warm-started adapter, then evaluation.
source bench/device/setup.sh
python3 bench/learning.py --train .carry/train.parquet --eval small=.carry/eval-small.parquet \
  --eval large=.carry/eval-large.parquet --eval three=.carry/eval-3agents.parquet --out-dir /tmp/runs/learn --skip-sft \
  --init-adapter /tmp/runs/learn/adapter-sft --set trajectories=6144 --set num_generations=8 --set prompts_per_step=32 \
  --set learning_rate=5e-5 --set max_completion_length=256 --set gradient_checkpointing=no --eval-batch-size 512 "$@" \
  2>&1 | grep -v -i "warn" | grep -v "^{" | tail -40
out=$(printf "%s\n" "$@" | grep -A1 -x -- --out-dir | tail -n1); [ -n "$out" ] && [ "$out" != "--out-dir" ] || out=/tmp/runs/learn
mkdir -p "$OUT" && cp "$out"/*.json "$OUT"/ 2>/dev/null
