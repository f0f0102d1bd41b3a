"""GPU throughput of rollout and LoRA GRPO training, on randomly initialised models of real shapes. A script, not a test.

    python bench/gpu.py [--archs qwen3-4b,smollm2-135m] [--json out.json] [--budget-s 480]

No weights are needed: the models are built from their configurations (Qwen3-4B; the embedded SmolLM2-135M's
architecture) with random bfloat16 weights, and prompts are random token ids, so only speed is measured.

Rollout (completion tokens/s, prompt 256 + 256 new tokens, sampling at temperature 1, nothing stops early):

- ``plain``: ``model.generate`` with its defaults (dynamic KV cache), the baseline;
- ``dynamic``: the project's path (``TransformersBackend.generate_ids``) with the dynamic cache;
- ``static``: the project's path as it runs on CUDA by default: preallocated KV cache, grouped-query decode attention
  without key/value copies (``policy/attention.py``), decode step compiled by ``torch.compile`` into CUDA graphs
  (``inductor``, or ``cudagraphs`` when Triton cannot build); ``static+KERNEL`` pins that decode attention's SDPA
  kernel (``cudnn``, ``efficient``, ``flash``, ``math``, or ``sdpa`` for PyTorch's own choice; ``static`` alone runs
  the default, ``auto``: the memory-efficient kernel on CUDA; ``policy.attention.set_decode_kernel``).

- ``vllm``: vLLM's offline engine (``LLM.generate`` on token ids, dummy weights of the same shape, CUDA graphs captured
  up to the largest vLLM batch asked for; vLLM's own default stops at 512), one
  engine per architecture built before its first row (``warmup_s`` of the first row holds the engine's start);
  ``vllm+lora``: the same with a random LoRA adapter (r=64 on every linear layer) applied by vLLM, not merged;
  ``vllm+fp8kv``: the same with the KV cache in FP8 (``kv_cache_dtype="fp8"``; FlashAttention 3 on Hopper).
  Sampling is seeded once, by the engine (``seed=0``), as the GRPO rollout samples; ``vllm+seeds`` runs the ``vllm``
  engine with a seed on every request instead (``SamplingParams(seed=...)``), which makes vLLM's sampler draw each
  seeded request's noise in its own call, one request after the other, at every decode step.

Every variant first runs once at full length (the static one compiles then; ``warmup_s``), then the timed run.

Training (tokens/s of forward + backward + AdamW step on LoRA r=16 over all linear layers, 16 sequences x 512 tokens):

- ``lm+ckpt``: next-token loss on every position with gradient checkpointing: the baseline's recipe;
- ``grpo+ckpt`` / ``grpo``: GRPO's loss (log-probabilities of the 256 completion tokens only, weighted by advantages,
  as TRL computes it with ``logits_to_keep``), with and without recomputation (``train.accel.gradient_checkpointing``);
- any of them ``+compile`` (``torch.compile`` of the LoRA model) and ``:BATCH`` (sequences per pass).

MFU counts the model's FLOPs (2 x forward: LoRA's frozen weights need no weight gradients; recomputation not counted)
against the card's dense bf16 peak. Writes JSON after every measurement (a crash keeps what ran) and prints a table last;
its "vs base" divides by the fastest ``plain`` (rollout) or ``lm+ckpt`` (training) run at that batch size, else at the
largest batch size that has one (plain ``generate`` varied 1.6x between fresh machines: list it twice).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envgen.core.files import atomic_write_text  # noqa: E402
from policy.attention import DECODE_KERNELS, set_decode_kernel  # noqa: E402

ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-4b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": True},
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
    "tiny": {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}
"""Architectures by name: the paper's model, the embedded model, and a tiny one for checking the script on a CPU."""

PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 peak FLOP/s by card name (first match wins)."""

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(arch: str, device: str, dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # random weights: never stop early, every row makes every token
    model.generation_config.pad_token_id = 0
    return model.eval()


def forward_flops_per_token(arch: str, seq: int) -> float:
    """Forward FLOPs per token: 2 per weight of every matrix multiply (lm_head included) plus causal attention."""
    a = ARCHS[arch]
    h, heads, kv, d, inter, layers = (a["hidden_size"], a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"],
                                      a["intermediate_size"], a["num_hidden_layers"])
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter
    matmul = layers * per_layer + h * a["vocab_size"]
    attention = layers * 2 * 2 * heads * d * (seq / 2)  # QK^T and AV over on average half the sequence
    return 2 * matmul + attention


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release(model: Any, device: str) -> None:
    """Forget the compiled decode step and give cached GPU memory back before the next variant."""
    import gc

    import torch

    from policy.backends import forget_compiled

    forget_compiled(model)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def profiled(profile: Path | None, name: str, device: str):
    """A torch profiler around the timed run that writes ``profile/name.txt`` (top operators by GPU and by CPU time, and
    how busy the GPU was), or a no-op context without ``profile``."""
    import contextlib

    if profile is None:
        return contextlib.nullcontext()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])

    @contextlib.contextmanager
    def run():
        start = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            yield
        sync(device)
        wall = time.perf_counter() - start
        events = prof.key_averages()
        # kernels only: ranges such as a compiled graph's launch also include the device time of the kernels they hold
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
        lines = [f"{name}: wall {wall:.2f} s under the profiler, GPU kernels {gpu_us / 1e6:.2f} s "
                 f"({gpu_us / 1e6 / wall:.0%} of wall: the rest the GPU waits for the CPU)", "",
                 events.table(sort_by="self_device_time_total" if len(activities) > 1 else "self_cpu_time_total",
                              row_limit=30, max_name_column_width=60), "",
                 events.table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60)]
        profile.mkdir(parents=True, exist_ok=True)
        atomic_write_text(profile / f"{name}.txt", "\n".join(lines))
        print(lines[0], flush=True)

    return run()


def rollout_variant(model: Any, device: str, variant: str, batch: int, prompt_len: int, new_tokens: int,
                    compile_backend: str, profile: Path | None = None, name: str = "") -> dict[str, Any]:
    import torch

    from policy.backends import SamplingParams, TransformersBackend
    from policy.models import LoadedModel

    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, stop=())
    if variant == "plain":
        def run(p: SamplingParams):
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=p.max_new_tokens, do_sample=True,
                                     temperature=1.0, top_k=None, top_p=None, pad_token_id=0)
            return out[:, prompt_len:]
    else:
        loaded = LoadedModel(model, SimpleNamespace(pad_token_id=0, eos_token_id=None), "random", None, device)
        backend = TransformersBackend.from_loaded(loaded, batch_size=batch, cache=variant, compile_backend=compile_backend)

        def run(p: SamplingParams):
            return backend.generate_ids(ids, mask, 1, p, seed=0)[0]  # falls back from a compiler that cannot build
    start = time.perf_counter()
    # A full-length warm-up: a short one leaves the allocator to grow during the timed run (measured on an H100: the
    # first batch-256 run of a process at half the speed of the next), and the static variant compiles for this cache
    # length (a shorter warm-up would compile another shape).
    run(params)
    sync(device)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    new = run(params)
    sync(device)
    seconds = time.perf_counter() - start
    with profiled(profile, f"{name}rollout-{variant}-{batch}", device):  # a third run, after the timed one
        run(params)
    tokens = int(new.shape[0] * new.shape[1])
    return {"part": "rollout", "variant": variant, "batch": batch, "prompt_len": prompt_len, "new_tokens": int(new.shape[1]),
            "seconds": seconds, "warmup_s": warmup, "tokens": tokens, "tok_per_s": tokens / seconds,
            "compile_backend": backend.compile_backend if variant == "static" else None}


VLLM_VARIANTS: dict[str, dict[str, Any]] = {
    "vllm": {},
    "vllm+seeds": {},
    "vllm+lora": {"enable_lora": True, "max_lora_rank": 64, "max_loras": 1},
    "vllm+fp8kv": {"kv_cache_dtype": "fp8"},
}
"""vLLM rollout variants and the engine options each adds: a random LoRA adapter applied by vLLM, or a KV cache in
FP8 (e4m3, scales of 1: half the bytes an attention step reads; keys and values rounded, so not the same numerics).
Variants with the same options share one engine (``vllm+seeds`` differs from ``vllm`` in its requests only)."""

SEEDED_VARIANTS = {"vllm+seeds"}
"""vLLM variants whose requests each carry a sampling seed (vLLM then draws each one's noise separately)."""


class VLLMEngines:
    """One vLLM engine per architecture (with LoRA enabled when a ``vllm+lora`` row asks for it), started on first use
    from a folder holding the model's configuration (and a random LoRA adapter), with dummy weights."""

    def __init__(self, max_batch: int, max_len: int, memory: float) -> None:
        self.max_batch, self.max_len, self.memory = max_batch, max_len, memory
        self.engines: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
        self.folders: dict[str, Path] = {}

    def folder(self, arch: str, model: Any) -> Path:
        import tempfile

        if arch not in self.folders:
            root = Path(tempfile.mkdtemp(prefix=f"vllm-{arch}-"))
            config = model.config
            config.architectures = [type(model).__name__]
            config.save_pretrained(root / "model")
            from peft import LoraConfig, get_peft_model

            lora = get_peft_model(model, LoraConfig(r=64, lora_alpha=64, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                                    task_type="CAUSAL_LM"))
            lora.save_pretrained(root / "adapter")
            lora.unload()
            self.folders[arch] = root
        return self.folders[arch]

    def get(self, arch: str, model: Any, variant: str) -> Any:
        options = VLLM_VARIANTS[variant]
        key = (arch, tuple(sorted(options.items())))
        if key not in self.engines:
            self.close()  # one engine at a time on the card
            from vllm import LLM

            root = self.folder(arch, model)
            self.engines[key] = LLM(model=str(root / "model"), load_format="dummy", skip_tokenizer_init=True,
                                    dtype="bfloat16", max_model_len=self.max_len, max_num_seqs=self.max_batch,
                                    max_num_batched_tokens=max(8192, self.max_len * 8), seed=0,
                                    compilation_config={"max_cudagraph_capture_size": self.max_batch},
                                    gpu_memory_utilization=self.memory, **options)
        return self.engines[key]

    def close(self) -> None:
        import gc

        import torch

        from policy.backends import stop_vllm_engine

        for engine in self.engines.values():
            stop_vllm_engine(engine)
        self.engines.clear()
        gc.collect()
        torch.cuda.empty_cache()


def vllm_variant(engines: VLLMEngines, arch: str, model: Any, variant: str, batch: int, prompt_len: int,
                 new_tokens: int) -> dict[str, Any]:
    """Completion tokens/s of vLLM on ``batch`` random prompts of ``prompt_len`` tokens, ``new_tokens`` each."""
    import random as _random

    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    lora = variant == "vllm+lora"
    start = time.perf_counter()
    engine = engines.get(arch, model, variant)
    rng = _random.Random(batch)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, model.config.vocab_size) for _ in range(prompt_len)])
               for _ in range(batch)]
    seeded = variant in SEEDED_VARIANTS
    params = [VSamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, min_tokens=new_tokens,
                              ignore_eos=True, seed=i if seeded else None, detokenize=False) for i in range(batch)]
    request = None
    if lora:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("random", 1, str(engines.folder(arch, model) / "adapter"))

    def run() -> int:
        outs = engine.generate(prompts, params, lora_request=request, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run()
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    return {"part": "rollout", "variant": variant, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "seconds": seconds, "warmup_s": warmup, "tokens": tokens, "tok_per_s": tokens / seconds}


def train_variant(model: Any, arch: str, device: str, variant: str, batch: int, seq: int, completion: int,
                  steps: int, peak: float | None) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    flags = set(variant.split("+")[1:])
    ckpt = "ckpt" in flags
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                                  task_type="CAUSAL_LM"))
    try:
        peft_model.train()
        if ckpt:
            peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            peft_model.enable_input_require_grads()
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-5)
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(1, model.config.vocab_size, (batch, seq), generator=gen).to(device)
        advantages = torch.randn(batch, 1, generator=gen).to(device)
        keep = completion + 1
        forward = torch.compile(peft_model) if "compile" in flags else peft_model

        def step() -> None:
            if variant.startswith("lm"):
                loss = forward(input_ids=ids, labels=ids).loss
            else:  # GRPO: log-probabilities of the completion tokens only, as TRL computes them (logits_to_keep)
                logits = forward(input_ids=ids, logits_to_keep=keep).logits[:, :-1].float()
                targets = ids[:, -completion:]
                logps = torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)
                loss = -(advantages * logps).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        start = time.perf_counter()
        step()  # warm-up (and compilation)
        sync(device)
        warmup = time.perf_counter() - start
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        seconds = (time.perf_counter() - start) / steps
    finally:
        if ckpt:
            peft_model.gradient_checkpointing_disable()
            peft_model.disable_input_require_grads()
        peft_model.unload()  # back to the plain model for the next variant
        model.eval()
    tokens = batch * seq
    tok_s = tokens / seconds
    model_flops = 2 * forward_flops_per_token(arch, seq) * tok_s
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return {"part": "train", "variant": variant, "batch": batch, "seq": seq, "completion": completion,
            "seconds_per_step": seconds, "warmup_s": warmup, "tokens": tokens, "tok_per_s": tok_s, "model_tflops": model_flops / 1e12,
            "mfu": model_flops / peak if peak else None, "peak_mem_gib": mem}


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "gcc": shutil.which("gcc") is not None, "device": device}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda"):
        info["card"] = torch.cuda.get_device_name()
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        info["card"] = platform.processor() or platform.machine()
    return info


def table(report: dict[str, Any]) -> str:
    lines = [f"card: {report['env'].get('card')}  torch {report['env']['torch']}  transformers {report['env']['transformers']}"]
    for arch, rows in report["results"].items():
        base: dict[tuple[str, int], float] = {}  # the fastest baseline run at each batch size (plain varies run to run)
        for r in rows:
            if "error" not in r and r["variant"] in ("plain", "lm+ckpt"):
                base[(r["part"], r["batch"])] = max(base.get((r["part"], r["batch"]), 0.0), r["tok_per_s"])
        lines.append(f"\n{arch}")
        lines.append(f"{'part':<8} {'variant':<18} {'shape':>10} {'tok/s':>10} {'vs base':>8} {'warmup s':>9} {'MFU':>6} {'mem GiB':>8}")
        for r in rows:
            if "error" in r:
                lines.append(f"{r['part']:<8} {r['variant']:<18} {r.get('shape', ''):>10}  error: {r['error']}")
                continue
            shape = f"{r['batch']}x{r.get('seq', r.get('prompt_len', 0) + r.get('new_tokens', 0))}"
            key = r["part"]
            ref = base.get((key, r["batch"])) or base.get((key, max((b for k, b in base if k == key), default=None)))
            ratio = f"{r['tok_per_s'] / ref:.2f}x" if ref else "-"
            mfu = f"{r['mfu']:.0%}" if r.get("mfu") is not None else "-"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
            warm = f"{r['warmup_s']:.1f}" if "warmup_s" in r else "-"
            lines.append(f"{r['part']:<8} {r['variant']:<18} {shape:>10} {r['tok_per_s']:>10.0f} {ratio:>8} {warm:>9} {mfu:>6} {mem:>8}")
    return "\n".join(lines)


def parse_list(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("--archs", default="qwen3-4b,smollm2-135m", help=f"comma-separated, from {sorted(ARCHS)}")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rollout", default="plain:1,plain:64,plain:256,dynamic:256,dynamic:512,static:256,static:512",
                        help="variant:batch pairs, in order (variants: plain, dynamic, static, vllm, vllm+seeds, vllm+lora, vllm+fp8kv; static+KERNEL pins the grouped decode step's SDPA kernel: cudnn, efficient, flash, math or sdpa, PyTorch's choice)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "cudagraphs", "none"],
                        help="for the static variant; the backend falls back to cudagraphs, then eager, if it cannot build")
    parser.add_argument("--train", default="lm+ckpt,grpo+ckpt,grpo", help="training variants, in order: 'lm' (next-token "
                        "loss) or 'grpo', with '+ckpt' (recompute activations) and/or '+compile' (torch.compile), and "
                        "optionally ':BATCH' (default --train-batch), e.g. grpo+compile:8")
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--train-seq", type=int, default=512)
    parser.add_argument("--train-completion", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=3, help="timed steps per training variant (after one warm-up)")
    parser.add_argument("--small-arch-rollout", default="plain:256,static:256,dynamic:1024,static:1024",
                        help="rollout variants for archs other than the first (compiles are costly: keep it short)")
    parser.add_argument("--vllm-memory", type=float, default=0.6, help="share of the GPU's memory a vLLM engine takes")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip what remains after this many seconds")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (after every measurement)")
    parser.add_argument("--profile", type=Path, default=None, help="also run each rollout variant once more under the "
                        "torch profiler and write its operator tables to this folder (ARCH-rollout-VARIANT-BATCH.txt)")
    args = parser.parse_args(argv)

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    env = environment(device)
    peak = peak_flops(env.get("card", "")) if device.startswith("cuda") else None
    env["peak_bf16_tflops"] = peak / 1e12 if peak else None
    report: dict[str, Any] = {"env": env, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "results": {}}
    t0 = time.perf_counter()
    vllm_rows = [int(item.split(":")[1]) for item in parse_list(args.rollout) + parse_list(args.small_arch_rollout)
                 if item.startswith("vllm")]
    engines = VLLMEngines(max(vllm_rows, default=1), args.prompt_len + args.new_tokens, args.vllm_memory)
    for index, arch in enumerate(parse_list(args.archs)):
        if arch not in ARCHS:
            parser.error(f"--archs: unknown {arch!r}; choose from {sorted(ARCHS)}")
        rows = report["results"].setdefault(arch, [])
        model = build_model(arch, device, args.dtype)
        plan = [("rollout", v) for v in parse_list(args.rollout if index == 0 else args.small_arch_rollout)]
        plan += [("train", v) for v in parse_list(args.train)]
        for part, item in plan:
            if time.perf_counter() - t0 > args.budget_s:
                rows.append({"part": part, "variant": item, "error": "skipped: over --budget-s"})
                continue
            try:
                if part == "rollout":
                    variant, batch = item.split(":")
                    if variant in VLLM_VARIANTS:
                        release(model, device)
                        row = vllm_variant(engines, arch, model, variant, int(batch), args.prompt_len, args.new_tokens)
                        row["arch"] = arch
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if args.json is not None:
                            atomic_write_text(args.json, json.dumps(report, indent=2))
                        continue
                    variant, _, kernel = variant.partition("+")
                    if variant not in ("plain", "dynamic", "static") or (kernel and (variant != "static" or kernel not in DECODE_KERNELS)):
                        parser.error(f"--rollout: unknown variant {item!r} (plain, dynamic, static, or static+KERNEL "
                                     f"with KERNEL one of {', '.join(DECODE_KERNELS)})")
                    set_decode_kernel(kernel or "auto")
                    try:
                        row = rollout_variant(model, device, variant, int(batch), args.prompt_len, args.new_tokens,
                                              args.compile_backend, args.profile, f"{arch}-")
                    finally:
                        set_decode_kernel("auto")
                    if kernel:
                        row["variant"], row["decode_kernel"] = f"static+{kernel}", kernel
                    if variant == "static":
                        release(model, device)
                else:
                    variant, _, batch = item.partition(":")
                    if variant.split("+")[0] not in ("lm", "grpo") or set(variant.split("+")[1:]) - {"ckpt", "compile"}:
                        parser.error(f"--train: bad variant {item!r} (lm or grpo, with +ckpt and/or +compile, then :BATCH)")
                    row = train_variant(model, arch, device, variant, int(batch or args.train_batch), args.train_seq,
                                        args.train_completion, args.train_steps, peak)
            except Exception as e:  # noqa: BLE001 - record it and go on: a benchmark run is expensive
                traceback.print_exc()
                row = {"part": part, "variant": item, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                release(model, device)
            row["arch"] = arch
            rows.append(row)
            print(json.dumps(row), flush=True)
            report["elapsed_s"] = time.perf_counter() - t0
            if args.json is not None:
                atomic_write_text(args.json, json.dumps(report, indent=2))
        release(model, device)
        engines.close()
        del model
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
