"""The policy side: model loading (:mod:`policy.models`), generation backends (:mod:`policy.backends`) and an
OpenAI-compatible server (:mod:`policy.serve`). Heavy libraries (torch, transformers, peft, vllm) load on first use."""
