"""Long context: varlen attention (no mask), the sequence-tiled MLP, a planner with nothing S x S, --max_context."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers import assert_near

from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.attention import resolve_attention, traceable_attention
from leantune.models.facts import check_context_length, extend_positions, position_limit
from leantune.models.presets import model_config
from leantune.models.tiled_mlp import tile_mlps, tile_tokens, tiled_tokens, untile_mlps
from leantune.data.segments import Segments, segments_of
from leantune.models.varlen_attention import SEGMENTS
from leantune.planning import plan_command as plan_cli
from leantune.planning.fake_step import prepare_step
from leantune.planning.max_context import CONTEXT_STEP, find_max_context, with_levers
from leantune.planning.plan import plan_modes

SHAPE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=101, max_position_embeddings=4096)
CPU = torch.device("cpu")


def twin_models(attentions=("sdpa", "varlen"), seed=0):
    """The same random float32 weights built with each attention."""
    models = []
    for attention in attentions:
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation=attention,
                                                       dtype=torch.float32).train())
    return models


def packed_positions(lengths, rows=2):
    return torch.cat([torch.arange(n) for n in lengths]).expand(rows, sum(lengths)).contiguous()


def hidden_and_grads(model, ids, positions=None, segments=None):
    kwargs = {SEGMENTS: segments} if segments is not None else {}
    decoder = model.get_decoder()
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).last_hidden_state
    # A fixed random direction, not hidden.pow(2).mean(): after the final RMSNorm that mean is nearly constant, so
    # its gradients are what is left of cancelling terms, float32 noise that no tolerance can judge.
    direction = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(11)).to(hidden)
    hidden.mul(direction).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_segments_start_where_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    assert segments_of(positions, 2, 8).lengths == ((3, 2, 3), (6, 2))
    assert segments_of(None, 3, 5) == Segments(((5,), (5,), (5,)))
    assert segments_of(positions, 2, 8).cumulative(CPU).tolist() == [0, 3, 5, 8, 14, 16]


def assert_varlen_matches_masked_sdpa(positions: torch.Tensor, seed: int) -> None:
    """varlen's hidden states and float32 gradients against sdpa's with the mask those positions make."""
    sdpa, varlen = twin_models()
    ids = torch.randint(0, 101, tuple(positions.shape), generator=torch.Generator().manual_seed(seed))
    dense, dense_grads = hidden_and_grads(sdpa, ids, positions)
    ours, our_grads = hidden_and_grads(varlen, ids, positions, segments_of(positions, *positions.shape))
    assert_near(ours, dense, 1e-5, "hidden")
    for name, grad in dense_grads.items():
        assert_near(our_grads[name], grad, 1e-5, name)


def test_varlen_gives_the_masked_sdpa_results_without_a_mask():
    assert_varlen_matches_masked_sdpa(packed_positions([10, 9, 5]), seed=1)


def test_varlen_keeps_each_example_to_itself_exactly():
    (model,) = twin_models(("varlen",))
    generator = torch.Generator().manual_seed(2)
    first, later = (torch.randint(0, 101, (1, 10), generator=generator),
                    torch.randint(0, 101, (1, 9), generator=generator))
    other = torch.randint(0, 101, (1, 10), generator=generator)
    positions = packed_positions([10, 9], rows=1)
    with torch.no_grad():
        packed = model.model(input_ids=torch.cat([first, later], 1), position_ids=positions).last_hidden_state
        moved = model.model(input_ids=torch.cat([other, later], 1), position_ids=positions).last_hidden_state
        alone = model.model(input_ids=later).last_hidden_state
    assert torch.equal(packed[:, 10:], moved[:, 10:])  # the example before it does not matter at all
    torch.testing.assert_close(packed[:, 10:], alone, rtol=1e-5, atol=1e-6)


def test_varlen_refuses_what_it_cannot_do_exactly():
    (model,) = twin_models(("varlen",))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="do not cover a batch"):
        model.model(input_ids=ids, **{SEGMENTS: Segments(((8,), (7,)))})


def test_auto_takes_varlen_and_sdpa_where_a_sliding_window_needs_a_mask():
    config = LlamaConfig(**SHAPE)
    assert resolve_attention(config, "auto", "cpu") == "varlen"
    windowed = copy.deepcopy(config)
    windowed.sliding_window = 512
    assert resolve_attention(windowed, "auto", "cpu") == "sdpa"
    with pytest.raises(ConfigError, match="sliding window of 512"):
        resolve_attention(windowed, "varlen", "cpu")
    # flash and flex keep the output and its log-sum-exp, no mask: planned as varlen, not as SDPA with a mask
    assert traceable_attention(config, "flash_attention_2") == "varlen"


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output has, and the most bytes any real (not fake) output has."""

    def __init__(self):
        super().__init__()
        self.numel, self.real_bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                if not is_fake(t) and t.device.type != "meta":
                    self.real_bytes = max(self.real_bytes, t.untyped_storage().nbytes())
        return out


def traced_largest(flags: list[str], context: int) -> LargestTensor:
    cfg = parse_run_config(["--model_name", "tiny", "--context_length", str(context), "--batch_size_training", "1",
                            "--loss_chunk_size", "1024", *flags])
    config = model_config("tiny")
    config.max_position_embeddings = context
    config._attn_implementation = resolve_attention(config, cfg.model.attn_implementation, "cpu")
    step = prepare_step(cfg, config, CPU, cfg.checkpointing.mode or "none")
    with LargestTensor() as largest:
        step.run()
    return largest


@pytest.mark.parametrize("flags", [[], ["--enable_activation_checkpointing"],
                                   ["--enable_activation_checkpointing", "--tiled_mlp", "2048"],
                                   ["--batching_strategy", "padding"], ["--packed_examples", "concatenated"]],
                         ids=["apart", "checkpointed", "tiled", "padding", "concatenated"])
def test_no_s_by_s_tensor_in_a_traced_step_on_the_paths_leantune_chooses(flags):
    context = 16384
    largest = traced_largest(flags, context)
    assert largest.numel < context * context // 8  # the largest here: the loss's chunk of logits (1024 x 2048)
    assert largest.real_bytes <= 16 * context  # nothing real beyond token and position ids (8 bytes a token)


def test_sdpa_asked_for_with_packing_apart_keeps_its_mask_and_the_test_above_would_see_it():
    context = 4096
    largest = traced_largest(["--attn_implementation", "sdpa"], context)
    assert largest.numel >= context * context
    assert largest.real_bytes <= 16 * context  # the mask is made on fake tensors: planned, never allocated


def test_tile_tokens_follow_the_flag():
    assert tile_tokens("off", 100_000, 4096) is None
    assert tile_tokens("auto", 8192, 4096) is None and tile_tokens("auto", 8193, 4096) == 4096
    assert tile_tokens("512", 4096, 64) == 512 and tile_tokens("512", 512, 64) is None


def with_mlp_lora(model, dropout=0.0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "down_proj"],
                                             lora_dropout=dropout))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_mlp_gives_the_untiled_float32_gradients(lora):
    plain, tiled = twin_models(("varlen", "varlen"))
    if lora:
        plain, tiled = with_mlp_lora(plain), with_mlp_lora(tiled)
        tiled.load_state_dict(plain.state_dict())  # the same adapters (peft draws lora_A from the global generator)
    assert tile_mlps(tiled, 7) == 2 and tiled_tokens(tiled) == 7
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(4))
    hidden, grads = hidden_and_grads(plain, ids)
    tiled_hidden, tiled_grads = hidden_and_grads(tiled, ids)
    assert_near(tiled_hidden, hidden, 1e-6, "hidden")  # a tile's matmuls may block otherwise
    assert grads.keys() == tiled_grads.keys()
    for name, grad in grads.items():  # weight gradients summed tile by tile: float32 rounding apart
        assert_near(tiled_grads[name], grad, 1e-5, name)
    untile_mlps(tiled)
    assert tiled_tokens(tiled) is None


def test_tiled_mlp_replays_lora_dropout_in_backward():
    (model,) = twin_models(("varlen",))
    model = with_mlp_lora(model, dropout=0.3)
    mlp = model.get_decoder().layers[0].mlp
    whole = mlp.forward
    tile_mlps(model, 7)
    x = torch.randn(2, 40, 64, requires_grad=True, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(9)
    mlp(x).pow(2).sum().backward()
    tiled_grad = x.grad.clone()
    x.grad = None
    torch.manual_seed(9)  # the same tiles, drawn in the same order, with autograd kept (nothing recomputed)
    torch.cat([whole(x[:, start:start + 7]) for start in range(0, 40, 7)], 1).pow(2).sum().backward()
    assert torch.equal(tiled_grad, x.grad)


def test_tiled_mlp_hands_each_weight_one_gradient_a_step():
    (model,) = twin_models(("varlen",))
    tile_mlps(model, 5)
    calls = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    model.model(input_ids=torch.zeros(1, 40, dtype=torch.long)).last_hidden_state.sum().backward()
    assert set(calls.values()) == {1}  # --optimizer_in_backward steps each weight once, not once a tile


@pytest.mark.parametrize("mode", ["full", "selective_ops", "every_n"])
def test_tiled_mlp_composes_with_checkpointing(mode):
    from leantune.checkpointing import apply_activation_checkpointing, policy_from_config

    plain, tiled = twin_models(("varlen", "varlen"))
    flags = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode]
    policy = policy_from_config(parse_run_config(flags).checkpointing)
    for model in (plain, tiled):
        apply_activation_checkpointing(model, policy, CPU)
    tile_mlps(tiled, 9)
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(6))
    _, grads = hidden_and_grads(plain, ids)
    _, tiled_grads = hidden_and_grads(tiled, ids)
    for name, grad in grads.items():
        assert_near(tiled_grads[name], grad, 1e-5, name)


def test_the_plan_sees_the_tiled_mlp_and_varlen_lower_the_peak():
    def peak(*flags):
        cfg = parse_run_config(["--model_name", "tiny", "--context_length", "2048", "--batch_size_training", "1",
                                "--enable_activation_checkpointing", *flags])
        config = model_config("tiny")
        config._attn_implementation = resolve_attention(config, cfg.model.attn_implementation, "cpu")
        return plan_modes(cfg, config, CPU, ["full"])[0]

    masked, varlen = peak("--attn_implementation", "sdpa", "--tiled_mlp", "off"), peak("--tiled_mlp", "off")
    tiled = peak("--tiled_mlp", "256")
    assert varlen.peak_bytes < masked.peak_bytes  # no 2048 x 2048 mask
    assert tiled.peak_bytes < varlen.peak_bytes and tiled.flops > varlen.flops  # one more MLP forward


@pytest.mark.parametrize("flags, mode", [([], "none"), (["--tiled_mlp", "off"], "full"),
                                         (["--tiled_mlp", "300"], "full"),
                                         (["--use_peft", "--tiled_mlp", "512"], "full"),
                                         (["--use_peft", "--tiled_mlp", "512"], "selective_ops")],
                         ids=["varlen", "checkpointed", "tiled", "lora-tiled", "lora-tiled-selective"])
def test_each_lever_is_planned_as_the_same_step_measures(flags, mode):
    """The fake trace (its tiles sampled: first and last) against the same step on real tensors, all tiles run."""
    from leantune.planning.fake_step import trace_step

    checkpointing = ([] if mode == "none"
                     else ["--enable_activation_checkpointing", "--activation_checkpointing_mode", mode])
    cfg = parse_run_config(["--model_name", "tiny", "--context_length", "2048", "--batch_size_training", "1",
                            *flags, *checkpointing])
    config = model_config("tiny")
    config._attn_implementation = "varlen"
    planned, measured = (trace_step(cfg, config, CPU, mode, fake=fake) for fake in (True, False))
    assert planned.peak_bytes == measured.peak_bytes and planned.breakdown == measured.breakdown
    assert planned.flops == measured.flops


def test_a_packed_rows_bytes_do_not_depend_on_how_many_examples_it_holds(monkeypatch):
    """The planner gives each row one packed span (MFU's whole-row attention); a real row holds several (its
    examples and its padding): both join their spans' outputs by one copy, so the plan holds for either."""
    from leantune.planning import fake_step

    cfg = parse_run_config(["--model_name", "tiny", "--context_length", "1024", "--batch_size_training", "2"])
    config = model_config("tiny")
    config._attn_implementation = "varlen"
    planned = fake_step.trace_step(cfg, config, CPU, "none")
    made = fake_step.full_rows_batch
    spans = Segments(((300, 700, 24), (1024,)), packed=True)
    monkeypatch.setattr(fake_step, "full_rows_batch", lambda *a, **k: {**made(*a, **k), "segments": spans})
    measured = fake_step.trace_step(cfg, config, CPU, "none", fake=False)
    assert planned.peak_bytes == measured.peak_bytes and planned.flops > measured.flops


def test_a_context_beyond_the_positions_names_the_flag_that_extends_them():
    config = model_config("Llama-3.1-8B")
    with pytest.raises(ConfigError, match="--rope_scaling_factor 4"):
        check_context_length(config, 500_000)
    extended = extend_positions(config, 4)
    assert position_limit(extended) == 4 * 131072 and position_limit(config) == 131072
    assert extended.rope_parameters["factor"] == 32.0 and extended.rope_parameters["rope_type"] == "llama3"
    check_context_length(extended, 500_000)


def test_max_context_finds_the_longest_context_that_fits():
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", "--rope_scaling_factor", "16"])
    config = extend_positions(model_config("tiny"), 16)
    config._attn_implementation = "varlen"
    budget = 160 * 2**20
    search = find_max_context(cfg, config, CPU, budget)
    best = search.best
    assert best.plan.fits and best.plan.context_length == search.max_context > 2048
    assert best.levers["activation_checkpointing_mode"] == "full"
    beyond = plan_modes(with_levers(cfg, best.levers, search.max_context + CONTEXT_STEP), config, CPU, ["full"],
                        budget)[0]
    assert not beyond.fits  # the next context searched (a multiple of 1024 here) does not fit


def test_max_context_reaches_the_models_own_position_limit_when_memory_allows_more():
    """The limit (4,096 with rope x2) is a context the search may end on, though neither of its first two traces
    is it."""
    cfg = parse_run_config(["--model_name", "tiny", "--batch_size_training", "1", "--rope_scaling_factor", "2"])
    config = extend_positions(model_config("tiny"), 2)
    config._attn_implementation = "varlen"
    search = find_max_context(cfg, config, CPU, 4 * 2**30)
    assert search.max_context == search.position_limit == 4096 < search.best.memory_allows
    assert search.best.plan.context_length == 4096 and search.best.plan.fits


def _result(context: int, flops: int, expandable: bool = False):
    from leantune.planning.max_context import ContextResult
    from leantune.planning.plan import ModePlan

    plan = ModePlan("full", "full", "cuda", 1, context, *([0] * 9), flops=flops, traced_tokens=context, fits=True)
    levers = {"activation_checkpointing_mode": "full", "tiled_mlp": "auto", "expandable_segments": expandable}
    return ContextResult(levers, context, plan, context, 2)


def test_the_longest_context_wins_and_of_equals_the_fewest_flops_then_the_allocator_as_it_is():
    from leantune.planning.max_context import best_of

    cheap, dear, longer = _result(8192, 8192 * 10), _result(8192, 8192 * 12), _result(9216, 9216 * 50)
    for order in ([cheap, dear], [dear, cheap]):
        assert best_of(order) is cheap
    assert best_of([cheap, dear, longer]) is longer
    settings, expanded = _result(8192, 8192 * 10), _result(8192, 8192 * 10, expandable=True)
    assert best_of([expanded, settings]) is settings and best_of([settings, expanded]) is settings


def test_plan_max_context_prints_one_json_object(capsys):
    code = plan_cli.main(["--model_name", "tiny", "--batch_size_training", "1", "--max_context",
                          "--memory_budget_gb", "0.2", "--json"])
    assert code == 0
    found = json.loads(capsys.readouterr().out)
    assert found["max_context"] == 2048 == found["position_limit"]  # tiny's positions end before its memory
    assert found["plan"]["context_length"] == 2048 and found["memory_allows"] > 2048
    assert found["flags"].startswith("--activation_checkpointing_mode full")


def test_plan_max_context_needs_a_budget(capsys):
    assert plan_cli.main(["--model_name", "tiny", "--max_context"]) == 2
    assert "--memory_budget_gb" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                    reason="needs a CUDA device of compute capability 8.0 or more")
def test_on_a_gpu_the_varlen_kernel_gives_sdpa_per_example():
    """bf16 on CUDA takes PyTorch's varlen flash kernel; its output and input gradients match SDPA run on each
    example alone (the CPU path's computation) within bf16 rounding."""
    from leantune.models import varlen_attention

    assert varlen_attention._varlen_kernel() is not None, "this PyTorch has no torch.nn.attention.varlen"
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, 96, 64, device="cuda", dtype=torch.bfloat16, generator=generator,
                           requires_grad=True) for heads in (8, 2, 2))
    segments = Segments(((40, 50, 6), (96,)))
    outputs = []
    for path in (varlen_attention._flash_varlen, varlen_attention._per_span_sdpa):
        args = (q, k, v, segments, 0.125) if path is varlen_attention._flash_varlen else (q, k, v, segments, 0.0, 0.125)
        out = path(*args)
        grads = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
        outputs.append((out.float(), [g.float() for g in grads]))
    (out, grads), (reference, reference_grads) = outputs
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=5e-2, atol=5e-2)
    assert varlen_attention._flash_varlen_usable(q, 0.0) and not varlen_attention._flash_varlen_usable(q.float(), 0.0)


def test_the_cpu_and_float32_take_sdpa_per_example():
    from leantune.models import varlen_attention

    assert not varlen_attention._flash_varlen_usable(torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16), 0.0)


def test_a_gpu_below_ampere_takes_sdpa_per_example(monkeypatch):
    """The flash kernel needs compute capability 8.0: a T4 (7.5) with float16 takes SDPA per example."""
    import types

    from leantune.models import varlen_attention

    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16)
    monkeypatch.setattr(varlen_attention, "_varlen_kernel", lambda: _stand_in_flash("newer", []))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, usable in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert varlen_attention._flash_varlen_usable(on_gpu, 0.0) is usable


def test_a_copy_of_a_tiled_model_runs_its_own_weights():
    (model,) = twin_models(("varlen",))
    tile_mlps(model, 5)
    twin = copy.deepcopy(model)
    twin.model(input_ids=torch.zeros(1, 40, dtype=torch.long)).last_hidden_state.sum().backward()
    assert all(p.grad is not None for layer in twin.model.layers for p in layer.mlp.parameters())
    assert all(p.grad is None for p in model.parameters())  # the original's weights took no part


def test_rows_with_different_spans_each_get_their_own():
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(9), torch.arange(5)]),
                             torch.cat([torch.arange(3), torch.arange(21)])])
    assert segments_of(positions, 2, 24).lengths == ((10, 9, 5), (3, 21))
    assert_varlen_matches_masked_sdpa(positions, seed=7)


def test_varlen_refuses_a_binding_sliding_window_a_padded_batch_and_a_multi_token_cache_step():
    from leantune.models.varlen_attention import VarlenAttentionError, varlen_attention_forward

    q, k = torch.zeros(1, 4, 12, 8), torch.zeros(1, 2, 12, 8)
    with pytest.raises(VarlenAttentionError, match="sliding window of 4 tokens"):
        varlen_attention_forward(torch.nn.Module(), q, k, k, None, sliding_window=4,
                                 **{SEGMENTS: Segments(((10, 2),), packed=True)})
    with pytest.raises(VarlenAttentionError, match="sliding window of 9 tokens and an example here is 10 long"):
        varlen_attention_forward(torch.nn.Module(), q, k, k, None, sliding_window=9,  # a window of W over W + 1
                                 **{SEGMENTS: Segments(((10, 2),), packed=True)})
    varlen_attention_forward(torch.nn.Module(), q, k, k, None, sliding_window=10,
                             **{SEGMENTS: Segments(((10, 2),), packed=True)})  # no span longer than the window
    with pytest.raises(VarlenAttentionError, match="several new tokens against a cache"):
        varlen_attention_forward(torch.nn.Module(), q[:, :, :3], k, k, None)
    (model,) = twin_models(("varlen",))
    with pytest.raises(VarlenAttentionError, match="padding in its attention mask"):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))


def test_the_norms_are_tiled_too_and_keep_no_float32_copies():
    (model,) = twin_models(("varlen",))
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(1, 40, 64, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes() -> int:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            norm.to(torch.bfloat16)(x)
        return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in kept}.values())

    whole = saved_bytes()
    tile_mlps(model, 8)
    assert saved_bytes() < whole // 2  # the input (bf16) and the weight only, no float32 copy of the input


def test_under_bf16_autocast_the_tiles_recompute_as_the_forward_ran():
    """Backward outside autocast (as the step runs it) recomputes each tile under the forward's autocast, its cast
    cache off as leantune's: the input gradient a per-tile autograd run gives, to float32 rounding."""
    from leantune.precision import Precision

    (model,) = twin_models(("varlen",))
    mlp = model.model.layers[0].mlp
    whole = mlp.forward
    precision = Precision(CPU, torch.float32, torch.bfloat16, False, "bf16 stand-in")
    x = torch.randn(1, 40, 64, requires_grad=True, generator=torch.Generator().manual_seed(8))
    tile_mlps(model, 8)
    with precision.autocast():
        tiled = mlp(x)
    tiled.float().pow(2).sum().backward()
    tiled_grad, x.grad = x.grad.clone(), None
    with precision.autocast():
        reference = torch.cat([whole(x[:, start:start + 8]) for start in range(0, 40, 8)], 1)
    reference.float().pow(2).sum().backward()
    torch.testing.assert_close(tiled_grad, x.grad, rtol=1e-6, atol=1e-8)


def test_compile_takes_sdpa_and_no_tiles_and_refuses_them_asked_for():
    config = LlamaConfig(**SHAPE)
    assert resolve_attention(config, "auto", "cpu", compiled=True) == "sdpa"
    with pytest.raises(ConfigError, match="not with --compile"):
        resolve_attention(config, "varlen", "cpu", compiled=True)
    assert parse_run_config(["--compile"]).training.tiled_mlp == "off"
    with pytest.raises(ConfigError, match="--tiled_mlp: 512: not with --compile"):
        parse_run_config(["--compile", "--tiled_mlp", "512"])


def test_positions_extend_for_each_kind_of_layer_and_chunked_attention_takes_sdpa():
    from transformers import AutoConfig

    gemma = AutoConfig.for_model("gemma3_text", max_position_embeddings=512)
    extended = extend_positions(gemma, 4)
    assert position_limit(extended) == 2048
    assert all(value["factor"] == 4 * gemma.rope_parameters[kind].get("factor", 1.0) or
               gemma.rope_parameters[kind].get("rope_type", "default") == "default" and value["factor"] == 4
               for kind, value in extended.rope_parameters.items())
    chunked = copy.deepcopy(LlamaConfig(**SHAPE))
    chunked.attention_chunk_size = 16
    assert resolve_attention(chunked, "auto", "cpu") == "sdpa"


def test_segments_know_their_longest_span_their_rows_and_their_offsets():
    segments = Segments(((3, 5), (2, 6)))
    assert segments.longest == 6 and segments.rows == 2 and not segments.one_span_per_row()
    offsets = segments.cumulative(torch.device("cpu"))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 8, 10, 16]
    assert Segments(((4,), (4,))).one_span_per_row() and not Segments(((4,), (3, 1))).one_span_per_row()
    assert Segments(((5, 4), (4, 5))).longest == 5 and segments.cumulative(torch.device("meta")).is_meta
    assert segments_of(packed_positions([3, 5], rows=2), 2, 8) == Segments(((3, 5), (3, 5)), packed=True)
    assert segments_of(None, 2, 8) == Segments(((8,), (8,)), packed=False)


def _reference(q, k, v, spans, scale, dropout=0.0):
    """Causal attention over each span alone, the key/value heads repeated: (B, S, H, D)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    rows = []
    for index, row in enumerate(spans):
        parts = [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale,
                                                                  dropout_p=dropout)
                 for a, b, c in zip(*(t[index:index + 1].split(list(row), dim=2) for t in (q, k, v)))]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2)


def _qkv(seed=0, length=12):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, length, 8, generator=generator) for heads in (4, 2, 2))


@pytest.mark.parametrize("spans", [((12,), (12,)), ((5, 7), (12,))])
def test_varlen_attends_within_spans_with_the_scale_given_and_one_call_a_batch_of_whole_rows(spans, monkeypatch):
    from leantune.models.varlen_attention import varlen_attention_forward

    q, k, v = _qkv()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs))
    whole = spans == ((12,), (12,))
    kwargs = {} if whole else {SEGMENTS: Segments(spans, packed=True)}  # whole rows: read from no position ids
    out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3, **kwargs)
    assert len(calls) == (1 if whole else 3)  # rows of one example each: the one call the sdpa path makes
    torch.testing.assert_close(out, _reference(q, k, v, spans, 0.3), rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    dropped, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, dropout=0.5, scaling=0.3, **kwargs)
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, _reference(q, k, v, spans, 0.3, dropout=0.5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [2, 4])  # as many tokens as key/value heads, as query heads
def test_grouped_heads_are_shared_whatever_the_rows_length(length):
    from leantune.models.varlen_attention import varlen_attention_forward

    q, k, v = _qkv(seed=4, length=length)
    out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, **{SEGMENTS: Segments(((length,),) * 2)})
    torch.testing.assert_close(out, _reference(q, k, v, ((length,), (length,)), None), rtol=1e-6, atol=1e-6)


def test_varlen_refuses_a_mask_soft_capping_and_sink_logits():
    from leantune.models.varlen_attention import VarlenAttentionError, varlen_attention_forward

    q, k, v = _qkv()
    segments = {SEGMENTS: Segments(((12,), (12,)))}
    with pytest.raises(VarlenAttentionError, match="takes no attention mask"):
        varlen_attention_forward(torch.nn.Module(), q, k, v, torch.zeros(2, 1, 12, 12), **segments)
    for extra in ({"softcap": 30.0}, {"s_aux": torch.zeros(4)}):
        with pytest.raises(VarlenAttentionError, match="Module soft-caps its scores or adds sink logits"):
            varlen_attention_forward(torch.nn.Module(), q, k, v, None, **segments, **extra)


def test_a_model_with_varlen_attention_generates_as_with_sdpa():
    """transformers' own generate: a cache, one new token at a time against it, is SDPA's call."""
    sdpa, varlen = twin_models()
    prompt = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(3))
    outputs = [model.eval().generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0) for model in
               (sdpa, varlen)]
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].shape[1] == 11


def _stand_in_flash(version: str, calls: list):
    """PyTorch's varlen flash kernel as a CPU reference (SDPA over each span), with the keywords of one of its
    versions: ``newer`` (window_size, grouped heads, scale), ``older`` (is_causal, scale) or ``first`` (is_causal
    only, PyTorch 2.9's); it records what it was given."""
    def attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, causal=False, enable_gqa=False):
        calls.append(dict(cu=cu_seq_q.tolist(), dtype=cu_seq_q.dtype, same=torch.equal(cu_seq_q, cu_seq_k),
                          longest=(max_q, max_k), heads=(query.shape[1], key.shape[1]), causal=causal,
                          gqa=enable_gqa, scale=scale, dtypes={t.dtype for t in (query, key, value)}))
        bounds = cu_seq_q.tolist()
        parts = [torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1)[None] for t in (query, key, value)), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)[0].transpose(0, 1) for a, b in zip(bounds, bounds[1:])]
        return torch.cat(parts)

    if version == "newer":
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                   enable_gqa=False):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, tuple(window_size) == (-1, 0),
                          enable_gqa)
    elif version == "older":
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal)
    else:
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None, is_causal)
    return kernel


@pytest.mark.parametrize("version", ["newer", "older", "first"])
def test_the_flash_call_gets_the_layout_offsets_heads_and_causality_its_kernel_takes(version, monkeypatch):
    """On a GPU the flattened batch goes to PyTorch's varlen kernel in one call; here a CPU stand-in with the
    signature of one of its versions checks what it is given (only keywords that version takes: a kernel without
    ``scale`` gets the query scaled, one without grouped heads the heads repeated) and computes the reference."""
    from leantune.models import varlen_attention

    calls = []
    monkeypatch.setattr(varlen_attention, "_varlen_kernel", lambda: _stand_in_flash(version, calls))
    monkeypatch.setattr(varlen_attention, "_flash_varlen_usable", lambda query, dropout: True)
    q, k, v = _qkv(seed=1)
    spans = ((5, 7), (3, 9))
    out, _ = varlen_attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3,
                                                       **{SEGMENTS: Segments(spans, packed=True)})
    torch.testing.assert_close(out, _reference(q, k, v, spans, 0.3), rtol=1e-6, atol=1e-6)
    assert calls == [dict(cu=[0, 5, 12, 15, 24], dtype=torch.int32, same=True, longest=(9, 9),
                          heads=(4, 2) if version == "newer" else (4, 4), causal=True, gqa=version == "newer",
                          scale=None if version == "first" else 0.3, dtypes={torch.float32})]
    # heads not grouped: no enable_gqa, nothing repeated; the model's scale None (the kernel's own): nothing scaled
    calls.clear()
    q, k, v = (torch.randn(2, 4, 12, 8, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2, 3))
    out, _ = varlen_attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=None,
                                                       **{SEGMENTS: Segments(spans, packed=True)})
    torch.testing.assert_close(out, _reference(q, k, v, spans, None), rtol=1e-6, atol=1e-6)
    assert calls[0]["heads"] == (4, 4) and calls[0]["gqa"] is False


def test_a_kernel_that_cannot_say_causal_is_not_used(monkeypatch):
    from leantune.models import varlen_attention

    def no_causality(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("called")

    import types

    monkeypatch.setattr(varlen_attention, "_varlen_kernel", lambda: no_causality)
    monkeypatch.setattr(varlen_attention, "cuda_capability", lambda device: (9, 0))
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert not varlen_attention._flash_varlen_usable(on_gpu, 0.0)
    monkeypatch.setattr(varlen_attention, "_varlen_kernel", lambda: _stand_in_flash("first", []))
    assert varlen_attention._flash_varlen_usable(on_gpu, 0.0)


def test_under_autocast_q_k_and_v_reach_the_kernel_in_autocasts_dtype(monkeypatch):
    """RoPE over float32 weights makes q and k float32 while v is bfloat16 (full fine-tuning under bf16
    autocast): all three reach the flash kernel in bfloat16, as autocast hands them to SDPA."""
    from leantune.models import varlen_attention

    calls = []
    monkeypatch.setattr(varlen_attention, "_varlen_kernel", lambda: _stand_in_flash("newer", calls))
    monkeypatch.setattr(varlen_attention, "_flash_varlen_usable", lambda query, dropout: query.dtype == torch.bfloat16)
    q, k, v = _qkv(seed=2)
    segments = Segments(((5, 7), (12,)), packed=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention.varlen_attention_forward(torch.nn.Module(), q, k, v.bfloat16(), None, scaling=0.3,
                                                           **{SEGMENTS: segments})
    assert len(calls) == 1 and calls[0]["dtypes"] == {torch.bfloat16} and out.dtype == torch.bfloat16
    expected = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), segments.lengths, 0.3)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    # without autocast, mixed inputs are promoted to the widest (SDPA itself would refuse them)
    assert {t.dtype for t in varlen_attention.in_one_dtype(q, k, v.bfloat16())} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # inputs that agree are left as they are, autocast or not
        assert all(a is b for a, b in zip(varlen_attention.in_one_dtype(q, k, v), (q, k, v)))
        assert {t.dtype for t in varlen_attention.in_one_dtype(q, k.bfloat16(), v.bfloat16())} == {torch.bfloat16}


def test_cu_seqlens_are_built_once_a_batch_and_device(monkeypatch):
    """Every layer's attention call (and its recompute) reads the batch's offsets; they are made once."""
    segments = Segments(((5, 7), (3, 9)), packed=True)
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    first = segments.cumulative(torch.device("cpu"))
    assert segments.cumulative(torch.device("cpu")) is first and len(made) == 1
    assert segments.cumulative(torch.device("meta")).is_meta and len(made) == 2
    assert segments == Segments(((5, 7), (3, 9)), packed=True)  # the cache is not part of what a batch is


def _tiled_layer_mlp(tokens=8):
    (model,) = twin_models(("varlen",))
    tile_mlps(model, tokens)
    return model, model.get_decoder().layers[0].mlp


def _graph_of(mlp, x) -> str:
    return type(mlp(x).grad_fn).__name__


def test_only_rows_longer_than_a_tile_run_in_tiles():
    _, mlp = _tiled_layer_mlp(8)
    tiled = "_TiledMLPFunctionBackward"
    assert _graph_of(mlp, torch.randn(2, 9, 64)) == tiled and _graph_of(mlp, torch.randn(9, 64)) == tiled
    assert _graph_of(mlp, torch.randn(2, 8, 64)) != tiled and _graph_of(mlp, torch.randn(64)) != tiled


def test_a_tiled_mlp_trains_its_weights_from_an_input_without_gradient_and_skips_an_unused_weight():
    plain, tiled = twin_models(("varlen", "varlen"))
    for model in (plain, tiled):  # a trainable weight the MLP never uses (an adapter switched off, say)
        model.get_decoder().layers[0].mlp.unused = torch.nn.Parameter(torch.ones(3))
    tile_mlps(tiled, 8)
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(7))  # no gradient wanted for it
    grads = []
    for model in (plain, tiled):
        mlp = model.get_decoder().layers[0].mlp
        mlp(x).pow(2).sum().backward()
        grads.append({name: None if p.grad is None else p.grad.clone() for name, p in mlp.named_parameters()})
    assert grads[1]["unused"] is None and grads[0].keys() == grads[1].keys()
    mlp, made, empty_like = tiled.get_decoder().layers[0].mlp, [], torch.empty_like
    with pytest.MonkeyPatch.context() as patched:  # no gradient buffer the size of an input that wants none
        patched.setattr(torch, "empty_like", lambda t, **kw: made.append(tuple(t.shape)) or empty_like(t, **kw))
        mlp(x).pow(2).sum().backward()
    assert (2, 30, 64) not in made
    for name, grad in grads[0].items():
        if grad is not None:
            assert_near(grads[1][name], grad, 1e-5, name)


def test_under_float16_autocast_the_tiles_recompute_in_float16():
    plain, tiled = twin_models(("varlen", "varlen"))
    tile_mlps(tiled, 8)
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(8))
    grads = []
    for model in (plain, tiled):
        mlp, inputs = model.get_decoder().layers[0].mlp, x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            out = mlp(inputs)
        assert out.dtype == torch.float16
        out.float().pow(2).sum().backward()
        grads.append(inputs.grad)
    # each row's MLP is the same computation in a tile: recomputed as the forward ran (float16), bit for bit
    assert torch.equal(grads[1], grads[0]) and not torch.equal(grads[0], _bf16_recomputed_grad(plain, x))


def _bf16_recomputed_grad(model, x):
    inputs = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.get_decoder().layers[0].mlp(inputs)
    out.float().pow(2).sum().backward()
    return inputs.grad


def test_tiling_again_changes_the_tile_untiling_twice_does_nothing_and_a_replaced_forward_is_refused():
    model, mlp = _tiled_layer_mlp(8)
    assert tile_mlps(model, 16) == 2 and tiled_tokens(model) == 16  # re-tiled, not wrapped twice
    untile_mlps(model)
    untile_mlps(model)
    assert tiled_tokens(model) is None and "forward" not in vars(mlp)
    mlp.forward = lambda x: x  # another library's hook on the instance
    with pytest.raises(TypeError, match="LlamaMLP's forward is replaced on the instance already"):
        tile_mlps(model, 8)


def test_a_layer_without_an_mlp_tiles_its_norms_only():
    from leantune.models.tiled_mlp import mlp_of, tiled_modules

    (model,) = twin_models(("varlen",))
    layer = model.get_decoder().layers[0]
    assert mlp_of(layer) is layer.mlp and len(tiled_modules(layer)) == 3
    layer.mlp = None  # an experts block leantune does not tile stands here in a mixture of experts
    assert mlp_of(layer) is None and tiled_modules(layer) == [layer.input_layernorm, layer.post_attention_layernorm]
    holder = torch.nn.Module()
    holder.mlp = "not a module"
    assert mlp_of(holder) is None


def test_on_cuda_the_tiles_replay_the_cuda_generator_too(monkeypatch):
    """The CUDA generator's state is saved with the CPU's and set again around each tile's recompute (CUDA's
    calls stood in: the device's state is a tensor like the CPU's)."""
    from leantune.models import tiled_mlp

    cuda_states, forked = [torch.tensor([7], dtype=torch.uint8)], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: cuda_states[-1])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: cuda_states.append(state))
    real_fork = torch.random.fork_rng

    def fork_rng(devices):
        forked.append(devices)
        return real_fork(devices=[])

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    gpu = torch.device("cuda", 0)
    state = tiled_mlp._rng_state(gpu)
    assert torch.equal(state[1], torch.tensor([7], dtype=torch.uint8)) and torch.equal(state[0], torch.get_rng_state())
    with tiled_mlp._replayed_rng(gpu, state):
        pass
    assert forked == [[gpu]] and len(cuda_states) == 2 and cuda_states[-1] is state[1]
    assert tiled_mlp._rng_state(CPU)[1] is None
    with tiled_mlp._replayed_rng(CPU, tiled_mlp._rng_state(CPU)):
        pass
    assert forked[-1] == [] and len(cuda_states) == 2


def test_varlen_is_a_name_transformers_takes_and_uses_torchs_varlen_kernel_where_there_is_one():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from leantune.models import varlen_attention

    for interface in (AttentionInterface, AttentionMaskInterface):
        interface._global_mapping.pop("varlen", None)
    varlen_attention.register()
    assert AttentionInterface._global_mapping["varlen"] is varlen_attention.varlen_attention_forward
    assert AttentionMaskInterface._global_mapping["varlen"] is varlen_attention.varlen_mask
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    assert varlen_attention._varlen_kernel() is varlen_attn


def test_tiles_sum_a_bfloat16_weights_gradient_in_float32():
    """Under --pure_bf16 or FSDP2's mixed precision the MLP's weights are bfloat16: the tiles' weight gradients
    are summed in float32 and rounded once at the end, never at every tile."""
    from leantune.loss import every_piece
    from leantune.models.tiled_mlp import _TiledMLPFunction, _Tiling

    generator = torch.Generator().manual_seed(3)
    up = torch.nn.Linear(16, 32, bias=False).bfloat16()
    down = torch.nn.Linear(32, 16, bias=False).bfloat16()

    def untiled(x):
        return down(torch.nn.functional.silu(up(x)))

    x = torch.randn(1, 64, 16, generator=generator).bfloat16()
    grad_out = torch.randn(1, 64, 16, generator=generator).bfloat16()
    weights = [up.weight, down.weight]
    out = _TiledMLPFunction.apply(untiled, _Tiling(4, every_piece), x, *weights)
    tiled = torch.autograd.grad(out, weights, grad_out)
    by_tile = [torch.autograd.grad(untiled(x[:, a:a + 4]), weights, grad_out[:, a:a + 4]) for a in range(0, 64, 4)]
    for index, (_weight, grad) in enumerate(zip(weights, tiled)):
        expected = sum(tile[index].float() for tile in by_tile).to(torch.bfloat16)
        assert grad.dtype == torch.bfloat16 and torch.equal(grad, expected)
    rounded_each_tile = by_tile[0][0].clone()
    for tile in by_tile[1:]:
        rounded_each_tile += tile[0]
    assert not torch.equal(rounded_each_tile, tiled[0])  # what the float32 sum avoids, here


class _OpCounter(TorchDispatchMode):
    """How many times each operator ran (by its qualified name)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket._qualified_op_name
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                    reason="needs a CUDA device of compute capability 8.0 or more")
def test_on_a_gpu_selective_ops_runs_each_layers_varlen_flash_forward_once():
    """selective_ops saves PyTorch's varlen operator's output: backward does not run the flash forward again."""
    from leantune.checkpointing import SelectiveOps, apply_activation_checkpointing

    (model,) = twin_models(("varlen",))
    model = model.to("cuda", torch.bfloat16)
    apply_activation_checkpointing(model, SelectiveOps())
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 64), device="cuda")
    positions = packed_positions((20, 44)).to("cuda")
    counter = _OpCounter()
    with counter:
        hidden_and_grads(model, ids, positions, segments_of(positions, 2, 64))
    layers = SHAPE["num_hidden_layers"]
    assert counter.counts.get("torch_attn::_varlen_attn") == layers, counter.counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_tiled_bf16_mlp_gives_the_untiled_output_and_gradients():
    plain, tiled = (model.to("cuda", torch.bfloat16) for model in twin_models(("varlen", "varlen")))
    tile_mlps(tiled, 16)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 96), device="cuda")
    (h_plain, g_plain), (h_tiled, g_tiled) = (hidden_and_grads(model, ids) for model in (plain, tiled))
    assert_near(h_tiled, h_plain, 2e-2, "hidden")
    for name, grad in g_plain.items():
        assert_near(g_tiled[name], grad, 5e-2, name)
