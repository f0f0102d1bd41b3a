#!/usr/bin/env bash
# Call 2 of the proof-of-learning run on the lent GPU: warm start on solver demonstrations, then evaluation.
source bench/device/setup.sh
python3 bench/learning.py --train .carry/train.parquet --eval small=.carry/eval-small.parquet \
  --eval large=.carry/eval-large.parquet --eval three=.carry/eval-3agents.parquet --out-dir /tmp/runs/learn --skip-grpo \
  --set sft_epochs=1 --set sft_batch_size=64 --set lora_r=64 --set lora_alpha=64 --set sft_learning_rate=1e-3 \
  --set gradient_checkpointing=no --eval-batch-size 512 "$@" 2>&1 | grep -v -i "warn" | grep -v "^{" | tail -40
out=$(printf "%s\n" "$@" | grep -A1 -x -- --out-dir | tail -n1); [ -n "$out" ] && [ "$out" != "--out-dir" ] || out=/tmp/runs/learn
mkdir -p "$OUT" && cp "$out"/*.json "$OUT"/ 2>/dev/null
