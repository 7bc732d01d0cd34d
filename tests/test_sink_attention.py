"""gpt-oss's attention sinks through SDPA (``--attn_implementation sinks``, auto's choice for gpt-oss): the same
logits, loss, gradients and generated tokens as transformers' eager attention, without its score matrices."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.memory.tracker import StorageTracker
from leantune.models.facts import run_model_facts
from leantune.models.sink_attention import NAME, SinkAttentionError, padded_head_dim, sink_attention_forward

WINDOW = 5  # shorter than the rows: the sliding layers' masks matter
LENGTH = 40  # longer than the padded head dimension (16 -> 24): a saved query is not mistaken for scores


def _model(path, attention: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks of either sign and of some size (they start at zero)
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
            if layer.self_attn.sliding_window:
                layer.self_attn.sliding_window = WINDOW
    model.config.sliding_window = WINDOW
    return model


def _batch(vocab: int, length: int = LENGTH):
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: transformers' mask has rows and columns masked
    return ids, mask


def test_auto_takes_sinks_for_gpt_oss_and_another_family_is_refused_it(moe_dir, family_dir):
    facts = run_model_facts(parse_run_config(["--model_name", str(moe_dir("gpt_oss"))]).model)
    assert facts.config._attn_implementation == NAME
    with pytest.raises(ConfigError, match="--attn_implementation sinks: LlamaForCausalLM does not support it"):
        run_model_facts(parse_run_config(["--model_name", str(family_dir("llama")), "--attn_implementation",
                                          "sinks"]).model)


def test_sinks_equal_eager_attention_in_float32(moe_dir):
    """Logits, loss and every gradient (the sinks' own included) within 1e-5 of eager, over sliding and full layers
    with a left-padded row; greedy generation (a cache: one new query at a time) gives the same tokens."""
    results = {}
    for attention in ("eager", NAME):
        model = _model(moe_dir("gpt_oss"), attention)
        ids, mask = _batch(model.config.vocab_size)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        tokens = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
        results[attention] = (out.logits.detach(), float(out.loss.detach()), grads, tokens)
    (logits, loss, grads, tokens), (our_logits, our_loss, our_grads, our_tokens) = results.values()
    torch.testing.assert_close(our_logits, logits, rtol=1e-5, atol=1e-5)
    assert our_loss == pytest.approx(loss, rel=1e-5)
    assert our_grads.keys() == grads.keys() and any("sinks" in n for n in grads)
    for name, grad in grads.items():
        assert float((our_grads[name] - grad).norm()) <= 1e-5 * max(float(grad.norm()), 1e-6), name
    assert torch.equal(our_tokens, tokens)


def test_sinks_keep_no_score_matrix(moe_dir):
    """Eager keeps each layer's batch x heads x seq x seq scores for backward (and their softmax with the sink
    column); sinks keeps no tensor of that size, and holds fewer bytes at its peak (at 256 tokens: at a few dozen, the
    padded channels and repeated key/value heads weigh more than the scores)."""
    peaks, largest, length = {}, {}, 256
    for attention in ("eager", NAME):
        model = _model(moe_dir("gpt_oss"), attention)
        ids, _ = _batch(model.config.vocab_size, length)
        sizes = []
        with StorageTracker() as tracker:
            # the hooks run within this iteration's forward: no late binding
            with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t,  # noqa: B023
                                                          lambda t: t):
                model(input_ids=ids)
        peaks[attention] = tracker.peak_bytes
        heads = model.config.num_attention_heads
        largest[attention] = {shape for shape in sizes if len(shape) == 4 and shape[1] == heads
                              and shape[2] == length and shape[3] >= length}
    assert largest["eager"] == {(2, heads, length, length + 1)}
    assert not largest[NAME]
    assert peaks[NAME] < peaks["eager"]


def test_sinks_under_bfloat16_autocast_stay_near_eager(moe_dir):
    losses = {}
    for attention in ("eager", NAME):
        model = _model(moe_dir("gpt_oss"), attention)
        ids, mask = _batch(model.config.vocab_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[attention] = float(model(input_ids=ids, attention_mask=mask, labels=ids).loss.detach())
    assert losses[NAME] == pytest.approx(losses["eager"], rel=2e-2)  # eager's softmax runs in bf16, SDPA's not


def test_the_head_dimension_is_padded_to_whole_units_and_a_call_without_sinks_is_refused():
    assert [padded_head_dim(d) for d in (64, 63, 71, 128)] == [72, 64, 72, 136]
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(SinkAttentionError, match="Linear passes no sink logits; use sdpa"):
        sink_attention_forward(torch.nn.Linear(1, 1), q, q, q, None)


def test_a_gpus_causal_mask_is_the_cpus_without_being_built_and_a_given_mask_gains_the_sinks_column():
    from leantune.models.sink_attention import _with_sink_column

    built = _with_sink_column(None, 5, 7, torch.device("cpu"))
    # the sink, then keys 0..i
    assert built.dtype == torch.bool and built.tolist()[0] == [True, True, True, False, False, False, False]
    lazy = _with_sink_column(None, 5, 7, torch.device("cuda"))  # a CausalBias: no CUDA needed to make one
    assert torch.equal(lazy._materialize(torch.device("cpu")), built)
    boolean = torch.tensor([[[[False, True], [True, True]]]])
    assert _with_sink_column(boolean, 2, 3, torch.device("cpu")).tolist() == [[[[True, False, True],
                                                                                  [True, True, True]]]]
    additive = torch.tensor([[[[float("-inf"), 0.0]]]])
    assert _with_sink_column(additive, 1, 3, torch.device("cpu")).tolist() == [[[[0.0, float("-inf"), 0.0]]]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_sinks_run_a_fused_kernel_in_bfloat16_near_eager(moe_dir):
    """A fused kernel takes the padded, masked call (no fallback: it would raise), with no score matrix kept."""
    losses, kept = {}, {}
    for attention in ("eager", NAME):
        model = _model(moe_dir("gpt_oss"), attention).cuda()
        ids, mask = (t.cuda() for t in _batch(model.config.vocab_size, 256))
        shapes = []
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(
                lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):  # noqa: B023 - called in this iteration
            losses[attention] = float(model(input_ids=ids, attention_mask=mask, labels=ids).loss.detach())
        kept[attention] = [s for s in shapes if len(s) == 4 and s[2] == 256 and s[3] >= 256]
    assert kept["eager"] and not kept[NAME]
    assert losses[NAME] == pytest.approx(losses["eager"], rel=2e-2)


def _reference(query, key, value, sinks, mask, scale):
    """Attention with per-head sinks written out: softmax over the scores and the sink, the sink's column dropped."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    combined = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return (combined.softmax(dim=-1)[..., :-1] @ value).transpose(1, 2)


@pytest.mark.parametrize("scaling, length", [(None, 6), (0.3, 6), (0.3, 3)])  # 3: keys with the sink = query heads
def test_the_call_itself_equals_attention_with_sinks_written_out(scaling, length):
    """Grouped heads, a head dimension that pads to 24, the model's scale or the default 1/sqrt(d), no mask given
    (the causal one built) and a boolean one given (a window of 3)."""
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(2, 4, length, 20, generator=generator)
    key, value = (torch.randn(2, 2, length, 20, generator=generator) for _ in range(2))
    sinks = torch.randn(4, generator=generator)
    scale = 20 ** -0.5 if scaling is None else scaling
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    window = causal & ~torch.ones(length, length, dtype=torch.bool).tril(-3)
    outs = []
    for given, mask in ((None, causal), (window.view(1, 1, length, length), window)):
        out, _ = sink_attention_forward(torch.nn.Module(), query, key, value, given, scaling=scaling, s_aux=sinks)
        torch.testing.assert_close(out, _reference(query, key, value, sinks, mask, scale), rtol=1e-5, atol=1e-6)
        outs.append(out)
    torch.manual_seed(0)
    dropped, _ = sink_attention_forward(torch.nn.Module(), query, key, value, None, dropout=0.5, scaling=scaling,
                                        s_aux=sinks)
    assert not torch.allclose(dropped, outs[0])  # dropout reaches SDPA


def test_on_a_gpu_only_fused_kernels_run_and_a_call_none_takes_is_refused_in_one_line():
    from leantune.models.sink_attention import _fused_kernels_only

    with _fused_kernels_only(torch.device("cpu")):
        assert torch.backends.cuda.math_sdp_enabled()  # the CPU's choice is left alone
    with _fused_kernels_only(torch.device("cuda")):
        assert not torch.backends.cuda.math_sdp_enabled()
    with pytest.raises(SinkAttentionError, match="no fused SDPA kernel of this GPU takes this call .*use "
                                                 "--attn_implementation eager"):
        with _fused_kernels_only(torch.device("cuda")):
            raise RuntimeError("No available kernel. Aborting execution.")
    with pytest.raises(RuntimeError, match="something else") as raised:
        with _fused_kernels_only(torch.device("cuda")):
            raise RuntimeError("something else")
    assert raised.type is RuntimeError  # passed on as it was


def test_registering_makes_the_name_one_transformers_accepts():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from leantune.models.sink_attention import register

    AttentionInterface._global_mapping.pop(NAME)
    AttentionMaskInterface._global_mapping.pop(NAME)
    register()
    assert AttentionInterface._global_mapping[NAME] is sink_attention_forward
    assert NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
