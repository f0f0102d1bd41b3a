"""Print the stack's versions and build a tiny random Llama with the carried SmolLM2 tokenizer in /tmp/tiny."""

import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import datasets
import peft
import pydantic
import transformers
import trl

print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.cuda.is_available()} "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''} transformers {transformers.__version__} "
      f"peft {peft.__version__} trl {trl.__version__} datasets {datasets.__version__} pydantic {pydantic.__version__}")
tok = AutoTokenizer.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else ".carry/tok")
config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                     eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
LlamaForCausalLM(config).save_pretrained("/tmp/tiny")
tok.save_pretrained("/tmp/tiny")
import tasks.rollout, tasks.train, policy.backends  # noqa: E401,F401,E402 - the step modules import here
print("step modules import; tiny model at /tmp/tiny")
