"""A decoder's training passes replayed as CUDA graphs: one forward and one backward graph per input shape.

With each decoder layer compiled on its own and CUDA graphs per layer (``compile_mode: reduce-overhead``), a training
pass of the embedded model still crosses 60 compiled regions from Python (30 layers, forward and backward), each with
a guard check, its wrappers and a graph launch; in a warm-start step the CPU was busier than the GPU
(docs/lab-notes/benchmarks.md). Here the decoder below the token embedding (the rotary embedding, every layer, the final norm)
is captured whole the first time a shape is seen (:func:`cuda_capture`, the recipe of
``torch.cuda.make_graphed_callables``), and every later pass of that shape replays two graphs: the forward, and the
backward, which also gives the trainable parameters' gradients.

It takes the passes whose shapes repeat: one padding-free row under grad mode with its demonstrations' boundaries and
longest length (``cu_seq_lens_q``, ``max_length_q``; as :class:`policy.accel.packed_attention.FixedSegments` makes them,
so a row's shapes depend only on its padded width). Any other call runs the decoder's own forward. The layers inside
may be compiled (their compiled kernels are what the graphs record). A shape's graphs hold their inputs, activations
and gradients at fixed addresses in a memory pool of their own, so the graphed parameters must keep their storage (the
optimizer updates them in place); the gradients are handed back as copies, so passes may accumulate them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

REQUIRED = ("embed_tokens", "layers", "norm", "rotary_emb")
"""What a decoder must have to be captured whole (Llama, Qwen2/3, SmolLM2 and their kind in transformers)."""


PASSED_ON = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "return_dict"})
"""Keyword arguments of a padding-free training pass that the captured stack takes as they are."""
UNASKED = frozenset({"output_attentions", "output_hidden_states"})
"""Keyword arguments a captured pass may carry only when false (the stack returns the last hidden state alone)."""


def decoder_of(model: Any) -> Any:
    """The decoder (transformers' base model: embedding, layers, final norm) under a PEFT or causal-LM model; raises
    when it lacks one of :data:`REQUIRED`."""
    from policy.lora import causal_lm

    causal = causal_lm(model)
    decoder = getattr(causal, getattr(causal, "base_model_prefix", "model"), None)
    missing = [name for name in REQUIRED if decoder is None or not hasattr(decoder, name)]
    if missing:
        raise ValueError(f"train.compile_mode = 'decoder-graph': {type(causal).__name__}'s decoder has no "
                         f"{', '.join(missing)} to capture; set train.compile_mode to 'reduce-overhead'")
    return decoder


class DecoderStack:
    """The decoder below its embedding as one function of tensors: ``(hidden, position_ids, cu_seq) -> hidden``, the
    rotary embedding, every layer (attention given the row's segments, no mask, no cache) and the final norm; the
    segments' longest length is fixed per stack (a graph records it)."""

    def __init__(self, decoder: Any, longest: int) -> None:
        self.decoder = decoder
        self.longest = longest

    def __call__(self, hidden: Any, position_ids: Any, cu_seq: Any) -> Any:
        d = self.decoder
        rotary = d.rotary_emb(hidden, position_ids=position_ids)
        segments = {"cu_seq_lens_q": cu_seq, "cu_seq_lens_k": cu_seq, "max_length_q": self.longest,
                    "max_length_k": self.longest}
        for layer in d.layers[: d.config.num_hidden_layers]:
            out = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=position_ids,
                        use_cache=False, **segments)
            hidden = out[0] if isinstance(out, tuple) else out
        return d.norm(hidden)


def copier(tensors: tuple[Any, ...]) -> Callable[[], list[Any]]:
    """A function that returns fresh copies of ``tensors``, in their order, with one multi-tensor operation per dtype.
    PyTorch's multi-tensor operations fall back to one kernel per tensor when a list mixes dtypes, as a decoder's
    gradients do (LoRA weights in float32, the bfloat16 input's gradient): 426 single-tensor kernels a step in a
    profile of the embedded model's warm start (docs/lab-notes/benchmarks.md), where one operation per dtype launches a few."""
    import torch

    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    lists = [(idx, [tensors[i] for i in idx]) for idx in groups.values()]

    def copies() -> list[Any]:
        out: list[Any] = [None] * len(tensors)
        for idx, group in lists:
            for i, copy in zip(idx, torch._foreach_mul(group, 1.0)):
                out[i] = copy
        return out

    return copies


WARMUP_PASSES = 3
"""Forward and backward passes run on a side stream before a capture (as ``torch.cuda.make_graphed_callables`` does):
the layers compile, and the allocator and kernels settle, before anything is recorded."""


def cuda_capture(stack: DecoderStack, sample: tuple[Any, ...]) -> Callable[..., Any]:
    """``stack`` captured on CUDA for the shapes of ``sample``: a function of the same tensors, differentiable in the
    decoder's trainable parameters (and in any input that requires grad), that replays a forward graph and, in the
    backward pass, a backward graph. The recipe of ``torch.cuda.make_graphed_callables`` (warm-up passes on a side
    stream, the forward captured, then ``torch.autograd.grad`` of its output captured, one memory pool for both), with
    two differences: the captures are thread-local (the data loader's pinning thread keeps working while they run),
    and the gradients are handed back as copies (one multi-tensor operation per dtype: :func:`copier`), so a second
    pass before the optimizer step adds to the first instead of overwriting it. Under autocast the capture runs in the
    autocast's dtype with its cache off (cached casts would outlive the graph), so it computes what the pass would."""
    import torch

    params = tuple(p for p in stack.decoder.parameters() if p.requires_grad)
    wanted = [a for a in sample if a.requires_grad] + list(params)
    static = tuple(sample)
    autocast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"),
                              cache_enabled=False)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with autocast, torch.cuda.stream(side):
        for _ in range(WARMUP_PASSES):
            out = stack(*static)
            torch.autograd.grad(out, wanted, grad_outputs=torch.zeros_like(out))
        del out
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with autocast:
        with torch.cuda.graph(forward_graph, pool=pool, capture_error_mode="thread_local"):
            static_out = stack(*static)
        static_grad_out = torch.zeros_like(static_out)
        with torch.cuda.graph(backward_graph, pool=pool, capture_error_mode="thread_local"):
            static_grads = torch.autograd.grad(static_out, wanted, grad_outputs=static_grad_out)
    needs = [a.requires_grad for a in static]
    copies = copier(tuple(static_grads))  # the pool's are rewritten next replay

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            for held, given in zip(static, args):
                if held.data_ptr() != given.data_ptr():
                    held.copy_(given)
            forward_graph.replay()
            return static_out.detach()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, grad: Any) -> Any:
            if grad.data_ptr() != static_grad_out.data_ptr():
                static_grad_out.copy_(grad)
            backward_graph.replay()
            grads = iter(copies())
            return (*(next(grads) if need else None for need in needs), *grads)

    def replay(*args: Any) -> Any:
        return Replay.apply(*args, *params)

    return replay


class GraphedForward:
    """The decoder's ``forward`` while :func:`decoder_graphs` is inside: a padding-free training row goes through the
    captured stack of its shape (captured on first sight by ``capture``: :func:`cuda_capture`, or a stand-in), anything
    else to ``original``. ``shapes`` counts the passes per captured shape ("1 x width")."""

    def __init__(self, decoder: Any, original: Callable[..., Any],
                 capture: Callable[[DecoderStack, tuple[Any, ...]], Callable[..., Any]]) -> None:
        self.decoder = decoder
        self.original = original
        self.capture = capture
        self.graphs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.shapes: dict[str, int] = {}

    def __call__(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                 inputs_embeds: Any = None, use_cache: bool | None = None, **kwargs: Any) -> Any:
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPast

        cu_seq, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        # what the decoder's own forward would only hand to its layers (seq_idx: a padding-free row's segment index,
        # for state-space layers; attention takes the boundaries) or not ask for (attentions, hidden states)
        extra = {k for k, v in kwargs.items() if k not in PASSED_ON and not (k in UNASKED and not v)}
        row = input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1
        if (not (torch.is_grad_enabled() and self.decoder.training) or not row or inputs_embeds is not None
                or attention_mask is not None or position_ids is None or cu_seq is None or longest is None
                or use_cache or extra):
            return self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = self.decoder.embed_tokens(input_ids)
        cu_seq = cu_seq.to(device=hidden.device, dtype=torch.int32)
        autocast = (torch.is_autocast_enabled(hidden.device.type)
                    and torch.get_autocast_dtype(hidden.device.type))
        key = (tuple(input_ids.shape), cu_seq.numel(), int(longest), hidden.dtype, hidden.requires_grad, autocast)
        args = (hidden, position_ids, cu_seq)
        graphed = self.graphs.get(key)
        if graphed is None:
            graphed = self.graphs[key] = self.capture(DecoderStack(self.decoder, int(longest)),
                                                      tuple(a.detach().clone().requires_grad_(a.requires_grad)
                                                            for a in args))
        name = "x".join(map(str, input_ids.shape))
        self.shapes[name] = self.shapes.get(name, 0) + 1
        return BaseModelOutputWithPast(last_hidden_state=graphed(*args))


@contextlib.contextmanager
def decoder_graphs(model: Any, enabled: bool,
                   capture: Callable[[DecoderStack, tuple[Any, ...]], Callable[..., Any]] | None = None,
                   ) -> Iterator[GraphedForward | None]:
    """While inside, the decoder of ``model`` (:func:`decoder_of`) replays padding-free training rows as CUDA graphs
    (:class:`GraphedForward`; ``capture``: :func:`cuda_capture` when None); its own forward and no graphs after.
    Gradient checkpointing is refused (its recomputation would run outside the graphs)."""
    if not enabled:
        yield None
        return
    if getattr(model, "is_gradient_checkpointing", False):
        raise ValueError("train.compile_mode = 'decoder-graph' cannot recompute activations; set "
                         "train.gradient_checkpointing to false, or train.compile_mode to 'reduce-overhead'")
    decoder = decoder_of(model)
    own = decoder.__dict__.get("forward")  # an instance's own forward (else the class's)
    graphed = GraphedForward(decoder, decoder.forward, cuda_capture if capture is None else capture)
    decoder.forward = graphed
    try:
        yield graphed
    finally:
        if own is None:
            del decoder.forward
        else:
            decoder.forward = own
        graphed.graphs.clear()
