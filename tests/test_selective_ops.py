"""selective_ops tells matmuls apart by the module that runs them, so no shape can change the policy.

The size-based rule it replaces recomputed every matmul whose reduction size matched the MLP
intermediate size or a LoRA rank: intermediate == hidden, rank == hidden or, with eager attention,
rank == head_dim silently changed what was saved. Each model here is a tiny random Llama (hidden
64, 4 heads of 16, 2 layers, float32).
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from leantune.checkpointing import SelectiveOps, apply_activation_checkpointing
from leantune.checkpointing import selective
from leantune.checkpointing.recomputed_linear import RecomputedLinear
from leantune.checkpointing.selective import unmark_recomputed_linears
from leantune.training.step import forward_hidden

from helpers import activation_bytes, gradients, make_batch

HIDDEN, HEAD_DIM, LAYERS = 64, 16, 2
# aten's, and the op of the Linears whose matmul is recomputed (RecomputedLinear)
MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.leantune.recomputed_linear.default}
SAVED, RECOMPUTED = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def tiny_llama(intermediate: int = 128, attn: str = "sdpa", lora_r: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=intermediate, num_hidden_layers=LAYERS,
                         num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=256, attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().train()
    if lora_r is None:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # random B: peft's zero B would make every A gradient zero
    lora = LoraConfig(r=lora_r, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"],
                      init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


@pytest.fixture
def record(monkeypatch):
    """Applies selective_ops to a model; the returned list gets the (op, decision) of each matmul
    the policy decides in a forward."""
    real = selective.create_selective_checkpoint_contexts

    def apply(model):
        decisions = []

        def recording(policy_fn, *args, **kwargs):
            def policy(ctx, op, *op_args, **op_kwargs):
                decision = policy_fn(ctx, op, *op_args, **op_kwargs)
                if op in MATMUL_OPS and not ctx.is_recompute:
                    decisions.append((op, decision))
                return decision

            return real(policy, *args, **kwargs)

        monkeypatch.setattr(selective, "create_selective_checkpoint_contexts", recording)
        apply_activation_checkpointing(model, SelectiveOps())
        return decisions

    return apply


def matmul_decisions(record, model, autocast: bool = False) -> Counter:
    decisions = record(model)
    ids, _ = make_batch(128, seq=32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        forward_hidden(model, ids).float().sum().backward()
    return Counter(decision for _, decision in decisions)


def activation_ratio(make) -> float:
    """selective_ops' live activation bytes after the forward, over no checkpointing's."""
    ids, _ = make_batch(128, batch=2, seq=256)
    none = activation_bytes(make(), ids)[0]
    model = make()
    apply_activation_checkpointing(model, SelectiveOps())
    return activation_bytes(model, ids)[0] / none


# Per layer, full FT: q, k, v, o, gate, up saved; down_proj recomputed. LoRA on q, v, down_proj:
# the 7 frozen projections and 3 lora_A saved, 3 lora_B recomputed. Eager attention adds QK^T
# and probabilities x V, both saved.
EXPECTED = {
    "full-ft": Counter({SAVED: 6 * LAYERS, RECOMPUTED: 1 * LAYERS}),
    "lora": Counter({SAVED: 10 * LAYERS, RECOMPUTED: 3 * LAYERS}),
    "eager-lora": Counter({SAVED: 12 * LAYERS, RECOMPUTED: 3 * LAYERS}),
}
PLAIN = {"full-ft": dict(), "lora": dict(lora_r=4), "eager-lora": dict(attn="eager", lora_r=4)}
COLLIDING = {
    "full-ft": dict(intermediate=HIDDEN),
    "lora": dict(lora_r=HIDDEN),
    "eager-lora": dict(attn="eager", lora_r=HEAD_DIM),
}
KINDS = sorted(EXPECTED)


@pytest.mark.parametrize("kind", KINDS)
def test_colliding_sizes_make_the_same_decisions(record, kind):
    assert matmul_decisions(record, tiny_llama(**PLAIN[kind])) == EXPECTED[kind]
    assert matmul_decisions(record, tiny_llama(**COLLIDING[kind])) == EXPECTED[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_colliding_sizes_keep_the_activation_ratio(kind):
    # Measured: full-ft 0.57 plain / 0.59 colliding, lora 0.60 / 0.65, eager-lora 0.85 / 0.86;
    # the size-based rule gave 0.25, 0.24 and 0.40 for the colliding models.
    plain = activation_ratio(lambda: tiny_llama(**PLAIN[kind]))
    colliding = activation_ratio(lambda: tiny_llama(**COLLIDING[kind]))
    assert abs(colliding - plain) < 0.08, (plain, colliding)


def test_eager_attention_saves_qk_when_the_rank_is_the_head_dim(record):
    plain, checkpointed = tiny_llama(attn="eager", lora_r=HEAD_DIM), tiny_llama(attn="eager", lora_r=HEAD_DIM)
    decisions = record(checkpointed)
    ids, labels = make_batch(128)
    expected, actual = gradients(plain, ids, labels), gradients(checkpointed, ids, labels)
    attention = [decision for op, decision in decisions if op == torch.ops.aten.bmm.default]
    assert attention == [SAVED] * (2 * LAYERS)  # QK^T and probabilities x V, in each layer
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast_makes_the_float32_decisions(record, kind):
    """Autocast multiplies fresh bf16 copies of frozen weights; the module still decides."""
    float32 = matmul_decisions(record, tiny_llama(**COLLIDING[kind]))
    bf16 = matmul_decisions(record, tiny_llama(**COLLIDING[kind]), autocast=True)
    assert bf16 == float32 == EXPECTED[kind]


def test_autocast_really_multiplies_in_bf16(record):
    model = tiny_llama(lora_r=4)
    decisions = record(model)
    dtypes = []
    model.get_base_model().model.layers[0].mlp.down_proj.base_layer.register_forward_hook(
        lambda module, args, output: dtypes.append(output.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward_hidden(model, make_batch(128, seq=16)[0])
    assert dtypes == [torch.bfloat16] and decisions


def test_marking_happens_once_and_is_undone():
    model = tiny_llama(lora_r=4)
    lora_b = model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"]
    weight = lora_b.weight
    SelectiveOps().bind(model)  # an earlier bind's marks are undone and made again, never stacked
    policy = apply_activation_checkpointing(model, SelectiveOps())
    assert type(lora_b) is RecomputedLinear and lora_b.weight is weight  # the same parameter, another forward
    assert "recompute elementwise ops, lora_B)" in policy.policy  # LoRA: down_proj's base is frozen, saved
    assert sum(type(m) is RecomputedLinear for m in model.modules()) == 3 * LAYERS
    unmark_recomputed_linears(model)
    assert not any(type(m) is RecomputedLinear for m in model.modules())


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("shape", [(3, 40, 16), (40, 16)], ids=["3d", "2d"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])  # Llama's mlp_bias, Qwen2's lora_B
def test_the_recomputed_op_gives_linears_outputs_and_gradients_bitwise(autocast, frozen, shape, bias):
    torch.manual_seed(0)
    plain, marked = torch.nn.Linear(16, 24, bias=bias), torch.nn.Linear(16, 24, bias=bias)
    marked.load_state_dict(plain.state_dict())
    marked.__class__ = RecomputedLinear
    x = torch.randn(*shape, requires_grad=True)
    results = []
    for layer in (plain, marked):
        for param in layer.parameters():
            param.requires_grad_(not frozen)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
        out.float().square().sum().backward()  # backward outside autocast, as the trainer's
        results.append((out, x.grad.clone(), None if frozen else [p.grad.clone() for p in layer.parameters()]))
    (out, grad_x, grad_w), (marked_out, marked_grad_x, marked_grad_w) = results
    assert out.dtype == marked_out.dtype == (torch.bfloat16 if autocast else torch.float32)
    # bitwise without a bias; a bias is added after the op (F.linear adds it inside), so with one the outputs
    # differ by a rounding and the gradients by what that rounding does downstream: within 1% of their norm
    # in bf16 (1e-6 in float32), where a dropped bias moves the output by a quarter of its norm
    same = torch.equal if not bias else functools.partial(_within, share=1e-2 if autocast else 1e-6)
    assert same(out, marked_out) and same(grad_x, marked_grad_x)
    assert (grad_w is None and marked_grad_w is None) or len(grad_w) == len(marked_grad_w) == 1 + bias
    assert all(same(plain_grad, marked_grad) for plain_grad, marked_grad in zip(grad_w or [], marked_grad_w or []))


def _within(expected: torch.Tensor, actual: torch.Tensor, share: float) -> bool:
    expected, actual = expected.float(), actual.float()
    return bool((expected - actual).norm() <= share * expected.norm())


@pytest.mark.parametrize("packet", [torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                    torch.ops.aten.baddbmm], ids=lambda p: p.__name__)
def test_every_overload_of_a_matmul_is_saved(packet):
    """A compiled graph may reach the policy with ``aten.mm.out`` where eager calls ``aten.mm.default``."""
    selective_policy = selective.selective_policy
    assert packet.overloads() and all(selective_policy(None, getattr(packet, name)) == CheckpointPolicy.MUST_SAVE
                                      for name in packet.overloads())
    assert selective_policy(None, torch.ops.aten.mul.out) == CheckpointPolicy.PREFER_RECOMPUTE


def test_every_overload_of_an_attention_kernel_is_saved():
    """SDPA's kernels' outputs are saved whatever overload reaches the policy."""
    kernels = [getattr(torch.ops.aten, name) for name in ("_scaled_dot_product_flash_attention_for_cpu",
                                                           "_scaled_dot_product_efficient_attention",
                                                           "_scaled_dot_product_flash_attention")
               if hasattr(torch.ops.aten, name)]
    overloads = [getattr(packet, name) for packet in kernels for name in packet.overloads()]
    assert overloads and all(selective.selective_policy(None, op) == CheckpointPolicy.MUST_SAVE for op in overloads)


def test_pytorchs_varlen_flash_attention_is_saved():
    """On a GPU leantune's varlen attention is PyTorch's ``torch_attn::_varlen_attn`` operator, which the policy
    sees whole (never the aten flash op inside it): saved, so backward does not run every layer's flash forward
    again, as the plan (traced with SDPA on the CPU) assumes."""
    import torch.nn.attention.varlen  # noqa: F401  (defines the operator)

    op = torch.ops.torch_attn._varlen_attn
    assert selective.is_attention(op.default) and selective.is_attention(op)
    assert selective.selective_policy(None, op.default) == CheckpointPolicy.MUST_SAVE
    assert not selective.is_attention(torch.ops.aten.mul.default)
