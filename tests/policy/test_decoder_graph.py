"""The decoder replayed as CUDA graphs (policy/accel/decoder_graph.py): which passes go through a captured stack, that the
stack computes the decoder's own forward, and that the decoder is itself again afterwards. CUDA graphs need CUDA; here
the capture is a stand-in that returns the stack (what the graphs record), so everything around it runs on the CPU."""

import pytest
import torch
from pydantic import ValidationError

from policy.accel.decoder_graph import DecoderStack, copier, decoder_graphs, decoder_of
from tests.helpers import train_settings


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()


def row(width=12, bounds=(0, 5, 9, 12)):
    """A padding-free row of ``width`` tokens in segments ``bounds`` (position ids restart in each)."""
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (1, width))
    cu = torch.tensor(bounds, dtype=torch.int32)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
    return {"input_ids": ids, "position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(b - a for a, b in zip(bounds[:-1], bounds[1:])),
            "max_length_k": max(b - a for a, b in zip(bounds[:-1], bounds[1:]))}


def per_segment_forward(model, inputs):
    """The decoder's own forward over each segment alone (what the row's attention within segments computes)."""
    bounds = inputs["cu_seq_lens_q"].tolist()
    outs = [model.model(input_ids=inputs["input_ids"][:, a:b], use_cache=False).last_hidden_state
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1)


def test_a_training_row_goes_through_one_capture_per_shape_and_matches_the_decoder(model):
    captured = []

    def stand_in(stack, sample):
        captured.append([tuple(a.shape) for a in sample])
        assert isinstance(stack, DecoderStack) and sample[0].requires_grad  # the embedding trains here (no adapter)
        return stack

    model.set_attn_implementation("sdpa")
    inputs = row()
    expected = per_segment_forward(model, inputs)
    # the stack as captured: sdpa per segment is what the varlen kernel computes on CUDA
    stack_attention = []

    def segmented(module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        stack_attention.append(kwargs["max_length_q"])
        cu = kwargs["cu_seq_lens_q"].tolist()
        parts = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                        is_causal=True, **{k: v for k, v in kwargs.items() if k == "scaling"})[0]
                 for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(parts, dim=1), None

    from transformers import AttentionInterface

    AttentionInterface.register("test_segmented", segmented)
    model.set_attn_implementation("test_segmented")
    with decoder_graphs(model, True, capture=stand_in) as graphed:
        decoder = decoder_of(model)
        out = decoder(**inputs, use_cache=False).last_hidden_state
        decoder(**inputs, use_cache=False)
        wider = row(16, (0, 5, 9, 16))
        decoder(**wider, use_cache=False)
        assert graphed.shapes == {"1x12": 2, "1x16": 1}
    assert len(captured) == 2 and captured[0] == [(1, 12, 64), (1, 12), (4,)]
    assert set(stack_attention) == {5, 7}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert "forward" not in vars(decoder)  # the class's forward again


def test_other_passes_run_the_decoders_own_forward(model):
    calls = []
    with decoder_graphs(model, True, capture=lambda stack, sample: calls.append(1) or stack) as graphed:
        decoder = decoder_of(model)
        inputs = row()
        with torch.no_grad():  # evaluation
            decoder(**inputs, use_cache=False)
        decoder(input_ids=inputs["input_ids"], use_cache=False)  # a padded batch: no boundaries
        decoder(**inputs, use_cache=False, output_attentions=True)  # asks for what the stack does not return
        decoder(**inputs, use_cache=True)
        decoder(**{**inputs, "input_ids": inputs["input_ids"].repeat(2, 1)}, use_cache=False)  # two rows
        model.eval()
        decoder(**inputs, use_cache=False)
        assert calls == [] and graphed.shapes == {}
        model.train()
        decoder(**inputs, use_cache=False, output_attentions=False, seq_idx=torch.zeros_like(inputs["input_ids"]))
        assert calls == [1] and graphed.shapes == {"1x12": 1}


def test_the_decoder_is_itself_again_after_and_untouched_when_off(model):
    decoder = decoder_of(model)
    with decoder_graphs(model, False) as graphed:
        assert graphed is None and "forward" not in vars(decoder)
    own = decoder.forward
    decoder.forward = own  # an instance's own forward is put back, not dropped
    with decoder_graphs(model, True, capture=lambda stack, sample: stack):
        assert vars(decoder)["forward"] is not own
    assert vars(decoder)["forward"] is own


def test_what_cannot_be_captured_is_refused_with_the_fix(model):
    with pytest.raises(ValueError, match="compile_mode to 'reduce-overhead'"), decoder_graphs(torch.nn.Linear(2, 2), True):
        pass
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing to false"), decoder_graphs(model, True):
        pass
    with pytest.raises(ValidationError, match="compile_scope to 'layers'"):
        train_settings(torch_compile="sft", compile_mode="decoder-graph")


def test_decoder_graph_applies_to_compiled_padding_free_warm_starts_on_cuda_only():
    from policy.accel.options import uses_decoder_graph
    from policy.accel.trainer import graph_steps

    on = train_settings(torch_compile="sft", compile_scope="layers", compile_mode="decoder-graph", sft_padding_free=True)
    assert uses_decoder_graph(on, "cuda", "sft")
    assert not uses_decoder_graph(on, "cpu", "sft") and not uses_decoder_graph(on, "cuda", "grpo")
    for off in ({"sft_padding_free": False}, {"torch_compile": False}, {"torch_compile": "grpo"},
                {"sft_packed_attention": "flex"}, {"compile_mode": "reduce-overhead"}):
        assert not uses_decoder_graph(on.model_copy(update={"accel": on.accel.model_copy(update=off)}), "cuda", "sft"), off
    assert graph_steps(on, "cuda", "sft") is None  # no cudagraph_mark_step_begin: torch.compile records no graphs


def test_the_gradients_are_copied_one_dtype_at_a_time_in_their_order(monkeypatch):
    """A multi-tensor operation over mixed dtypes takes PyTorch's one-kernel-per-tensor fallback: the copies go one
    dtype per call, and come back in the order given, as new tensors with the same values."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    grads = (torch.randn(3, dtype=bf16), torch.randn(2, 4), torch.randn(5), torch.randn(2, dtype=bf16))
    calls = []
    real = torch._foreach_mul

    def counted(tensors, scalar):
        calls.append({t.dtype for t in tensors})
        return real(tensors, scalar)

    monkeypatch.setattr(torch, "_foreach_mul", counted)
    copies = copier(grads)()
    assert sorted(map(sorted, calls), key=str) == sorted([[torch.bfloat16], [torch.float32]], key=str)
    for given, copy in zip(grads, copies, strict=True):
        assert copy.dtype == given.dtype and torch.equal(copy, given)
        assert copy.data_ptr() != given.data_ptr()
    grads[1].add_(1)  # the captured buffers are rewritten at the next replay: the copies keep their values
    assert not torch.equal(copies[1], grads[1])
