"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss, Llama 4): each trains on exactly its own loss, the router's
load-balancing term included when asked, or is refused before a weight loads.

Each family is built tiny (``leantune.models.tiny.MOE_FAMILIES``) with random routers, so tokens spread over the
experts; leantune's loss is compared with the model's own ``forward(labels=...)`` on the same batch.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_near, make_batch
from transformers import AutoConfig, AutoModelForCausalLM

from leantune import finetuning
from leantune.builders.model import build_model
from leantune.builders.own_loss import OwnLossMismatch, check_own_loss
from leantune.builders.loss_and_optimizer import loss_model_for
from leantune.flags import parse_run_config
from leantune.config import ConfigError, TrainingConfig
from leantune.labels import count_targets
from leantune.models.facts import ModelFacts, run_model_facts
from leantune.models.experts import _experts_of
from leantune.models.moe import RouterLoss, load_balancing_loss
from leantune.models.tiny import MOE_FAMILIES
from leantune.precision import choose_precision

CPU = torch.device("cpu")
ROUTED = ["qwen3_moe", "mixtral", "gpt_oss"]  # whose own loss adds the router's term (Llama 4's does not)


def _built(path, *flags):
    cfg = parse_run_config(["--model_name", str(path), *flags])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
    return cfg, model, loss_model_for(model, cfg.training, sharded=False)


def _padded_batch(vocab: int):
    ids, labels = make_batch(vocab, seq=24)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding: no targets there, and no tokens for the router's loss
    labels[1, -5:] = -100
    return ids, labels, mask


@pytest.mark.parametrize("loss", ["chunked", "plain"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_loss_and_gradients_are_the_models_own(moe_dir, family, loss):
    _, model, loss_model = _built(moe_dir(family), "--loss_chunk_size", "7" if loss == "chunked" else "0")
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    ours = loss_model(ids, labels) / count_targets(labels)
    ours.backward()
    our_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    own = model(input_ids=ids, labels=labels).loss
    own.backward()
    assert float(ours.detach()) == pytest.approx(float(own.detach()), rel=1e-5)
    for name, param in model.named_parameters():
        assert_near(our_grads[name], param.grad, 1e-5, name)
    assert any("experts" in n and g.abs().sum() > 0 for n, g in our_grads.items())  # the experts do train


@pytest.mark.parametrize("family", ROUTED)
def test_the_routers_loss_is_the_models_own_over_real_tokens(moe_dir, family):
    """--output_router_logits: cross-entropy + coefficient x load balancing, padding not counted, as transformers'."""
    attention = "eager" if family == "gpt_oss" else "sdpa"  # an attention that reads the padding mask
    _, model, loss_model = _built(moe_dir(family), "--output_router_logits", "--attn_implementation", attention,
                                  "--loss_chunk_size", "7")
    ids, labels, mask = _padded_batch(model.config.vocab_size)
    ours = loss_model(ids, labels, real_tokens=mask) / count_targets(labels)
    ours.backward()
    our_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    own.loss.backward()
    assert float(ours.detach()) == pytest.approx(float(own.loss.detach()), rel=1e-6, abs=1e-6)
    for name, param in model.named_parameters():
        assert_near(our_grads[name], param.grad, 1e-5, name)
    router = [n for n in our_grads if ".gate." in n or ".router." in n]
    assert router and all(our_grads[n].abs().sum() > 0 for n in router)
    # the term is there and counts real tokens only: without the mask (padding counted) it is another
    balance = float(loss_model.router_loss_sum) / count_targets(labels)
    assert balance == pytest.approx(float(own.aux_loss.detach()), rel=1e-6)
    unmasked = load_balancing_loss([t.detach() for t in own.router_logits], loss_model.router_loss)
    assert abs(float(unmasked) - balance) > 1e-4


def test_the_load_balancing_loss_by_hand():
    """Two tokens, two experts, top 1: fractions (1/2, 1/2), probabilities (p0, p1) averaged; loss 2 x sum."""
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]])
    probs = torch.softmax(logits, -1)
    rule = RouterLoss(num_experts=2, top_k=1, coefficient=0.1)
    expected = 2 * (0.5 * probs[:2, 0].mean() + 0.5 * probs[:2, 1].mean())
    got = load_balancing_loss((logits,), rule, real_tokens=torch.tensor([1, 1, 0]))
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    two_layers = load_balancing_loss((logits[:2], logits[:2]), rule)  # layers pooled: the same here
    assert float(two_layers) == pytest.approx(float(expected), rel=1e-6)
    # three tokens, none masked: every token counted (the rows, not the experts, make the average)
    probs3 = torch.softmax(logits, -1)
    fractions = torch.tensor([2 / 3, 1 / 3])  # tokens 0 and 2 pick expert 0, token 1 expert 1
    unmasked = 2 * (fractions * probs3.mean(0)).sum()
    assert float(load_balancing_loss((logits,), rule)) == pytest.approx(float(unmasked), rel=1e-6)


def test_checkpointing_gives_exactly_the_plain_gradients_with_the_routers_loss(moe_dir):
    grads = []
    for flags in ([], ["--enable_activation_checkpointing"]):
        _, model, loss_model = _built(moe_dir("qwen3_moe"), "--output_router_logits", *flags)
        ids, labels, mask = _padded_batch(model.config.vocab_size)
        loss_model(ids, labels, real_tokens=mask).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_a_run_logs_the_routers_loss_each_step_and_its_first_loss_is_the_models_own(moe_dir, tmp_path, write_jsonl):
    path = moe_dir("mixtral")
    data = write_jsonl([{"text": "The quick brown fox jumps over the lazy dog. " * 3}] * 8)
    argv = ["--model_name", str(path), "--output_router_logits", "--dataset", "custom_dataset", "--data_path",
            str(data), "--context_length", "48", "--batching_strategy", "padding", "--batch_size_training", "1",
            "--max_train_step", "2", "--num_epochs", "1", "--run_validation", "false", "--num_workers_dataloader", "0",
            "--save_metrics", "--save_model", "false", "--output_dir", str(tmp_path / "out")]
    lines: list[str] = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    assert any("+ router load-balancing loss × 0.001 (4 experts, top 2" in line for line in lines
               if line.startswith("loss check:"))
    step_lines = [line for line in lines if " step " in line and "router load balancing" in line]
    assert len(step_lines) == 2
    first = json.loads((tmp_path / "out" / "metrics.json").read_text())["train_steps"][0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from leantune.builders.loaders import RunData
    from leantune.models.loading import load_tokenizer

    cfg = parse_run_config(argv)
    loader, _ = RunData(cfg.data, cfg.training, load_tokenizer(cfg.model), log=lambda _line: None).loaders(cfg.training)
    batch = next(iter(loader))
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                    output_router_logits=True)
    assert first["loss"] == pytest.approx(float(own.loss), rel=1e-5)
    assert first["router_loss"] == pytest.approx(float(own.aux_loss), rel=1e-5)


def test_llama4s_causal_lm_is_checked_through_its_model_and_its_missing_router_loss_refused(moe_dir):
    """Llama 4's text class keeps its decoder as ``model`` (transformers' get_decoder() returns the whole model)."""
    facts = run_model_facts(parse_run_config(["--model_name", str(moe_dir("llama4"))]).model)
    assert check_own_loss(TrainingConfig(), facts, sharded=False).architecture == "Llama4ForCausalLM"
    routed = run_model_facts(parse_run_config(["--model_name", str(moe_dir("llama4")), "--output_router_logits"]).model)
    with pytest.raises(OwnLossMismatch, match="Llama4ForCausalLM: --output_router_logits .*this class's own loss adds "
                                              "no router load-balancing term"):
        check_own_loss(TrainingConfig(), routed, sharded=False)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_real_shaped_moe_configs_pass_the_check_with_the_routers_loss(model_type):
    config = AutoConfig.for_model(model_type, output_router_logits=True)
    check = check_own_loss(TrainingConfig(), ModelFacts(config), sharded=False)
    assert check.router_loss is not None and check.router_loss.coefficient == config.router_aux_loss_coef
    assert check.loss_difference < 1e-5 and check.gradient_difference < 1e-4


def test_the_routers_loss_on_a_dense_model_is_refused(family_dir):
    with pytest.raises(ConfigError, match="--output_router_logits: LlamaConfig is not a mixture of experts"):
        run_model_facts(parse_run_config(["--model_name", str(family_dir("llama")), "--output_router_logits"]).model)


def test_gpt_oss_pads_its_rows_saying_why(moe_dir, tmp_path):
    argv = ["--model_name", str(moe_dir("gpt_oss")), "--context_length", "64", "--batch_size_training", "2",
            "--max_train_step", "1", "--num_epochs", "1", "--run_validation", "false", "--save_model", "false",
            "--num_workers_dataloader", "0", "--output_dir", str(tmp_path / "out")]
    lines: list[str] = []
    finetuning.run(parse_run_config(argv), log=lines.append)
    assert any(line.startswith("data: padding, one example a row: GptOssForCausalLM cannot keep examples packed")
               for line in lines)
    assert any("(padding) per epoch" in line for line in lines)
    assert not any(line.startswith("packing:") for line in lines)


# ------------------------------------------------------------------------------------------- LoRA on the experts
def _lora(path, *targets, router=False, rank="2"):
    flags = ["--use_peft", "--lora_dropout", "0", "--lora_r", rank, "--lora_target_modules", *targets]
    torch.manual_seed(0)  # peft's A from the global generator: the same whichever tests ran before
    cfg, model, loss_model = _built(path, *flags, *(["--lora_router"] if router else []))
    with torch.no_grad():  # peft starts B at zero: give the low-rank paths a value
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return cfg, model, loss_model


def _merged_by_hand(model) -> torch.nn.Module:
    """The base model whose fused expert tensors hold W + scale x B_e A_e for each expert e, by hand (einsum)."""
    from leantune.model_structure import unwrap_model

    merged = AutoModelForCausalLM.from_config(unwrap_model(model).config, dtype=torch.float32)
    state = {}
    for name, module in model.named_modules():
        # a linear layer's (Llama 4's shared expert)
        if type(module).__name__ == "Linear" and hasattr(module, "lora_A"):
            lora = module.lora_B["default"].weight @ module.lora_A["default"].weight * module.scaling["default"]
            key = name.replace("base_model.model.", "") + ".weight"
            state[key] = (module.base_layer.weight + lora).detach()
            continue
        if type(module).__name__ != "ParamWrapper":
            continue
        base = module.get_base_layer()
        weight = getattr(base, module.parameter_name)
        experts = weight.shape[0]
        a = module.lora_A["default"].weight.reshape(experts, -1, module.lora_A["default"].weight.shape[-1])
        b = module.lora_B["default"].weight.reshape(module.lora_B["default"].weight.shape[0], -1, experts)
        delta = torch.einsum("ore,eri->eoi", b, a) * module.scaling["default"]  # [experts, B rows, A columns]
        delta = delta if delta.shape == weight.shape else delta.transpose(1, 2)
        key = name.replace("base_model.model.", "").replace(".base_layer", "") + "." + module.parameter_name
        state[key.replace(f".{module.parameter_name}.{module.parameter_name}", f".{module.parameter_name}")] = \
            weight.detach() + delta.detach()
    base_state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v.detach()
                  for k, v in model.named_parameters() if "lora_" not in k}
    merged.load_state_dict({**base_state, **state}, strict=True)
    return merged


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_the_experts_is_the_merged_models_loss(moe_dir, family):
    """Each expert's low-rank pair applied: the loss is that of a model whose experts hold W + scale x B A."""
    _, model, loss_model = _lora(moe_dir(family), "gate_up_proj", "down_proj")
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    with torch.no_grad():
        ours = float(loss_model(ids, labels)) / count_targets(labels)
        merged = float(_merged_by_hand(model)(input_ids=ids, labels=labels).loss)
        with model.disable_adapter():
            plain = float(loss_model(ids, labels)) / count_targets(labels)
    assert ours == pytest.approx(merged, rel=1e-5)
    assert abs(ours - plain) > 1e-3  # the experts' LoRA does change the loss


@pytest.mark.parametrize("router", [False, True])
def test_the_base_experts_and_the_routers_stay_unless_asked_while_the_experts_lora_moves(moe_dir, router):
    _, model, loss_model = _lora(moe_dir("qwen3_moe"), "all-linear", router=router)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    loss_model(ids, labels).backward()
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved and all("lora_" in n for n in moved)
    assert any("experts" in n and "lora_A" in n for n in moved) and any("self_attn" in n for n in moved)
    assert any(".gate." in n for n in moved) == router


def test_the_run_log_names_what_lora_wraps(moe_dir):
    lines = []
    cfg = parse_run_config(["--model_name", str(moe_dir("llama4")), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "all-linear"])
    build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    line = next(line for line in lines if line.startswith("lora:"))
    assert "modules down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj and parameters " in line
    assert "experts.gate_up_proj" in line and "experts.down_proj" in line
    assert "routers frozen (--lora_router trains them)" in line


@pytest.mark.parametrize("flags, message", [
    (["--lora_target_modules", "q_proj", "experts"], "experts is no linear layer or expert tensor of "
                                                     "Qwen3MoeForCausalLM; its linear layers and expert tensors are"),
    (["--lora_target_modules", "gate"], "gate is the router of Qwen3MoeForCausalLM's experts; LoRA on the routers "
                                        "comes with --lora_router"),
    (["--lora_target_modules", "down_proj", "--lora_dropout", "0.1"], "--lora_dropout 0.1 with LoRA on "
                                                                      "experts.down_proj: peft's LoRA on a fused"),
])
def test_bad_expert_lora_input_gets_one_line_before_loading(moe_dir, flags, message):
    from leantune.models.loading import ModelLoadError

    cfg = parse_run_config(["--model_name", str(moe_dir("qwen3_moe")), "--use_peft", *flags])
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_model_facts(cfg.model).check_lora_targets(cfg.peft)


def test_the_router_flag_needs_lora(family_dir, moe_dir):
    with pytest.raises(ConfigError, match="--lora_router: puts LoRA on the routers and needs --use_peft"):
        parse_run_config(["--lora_router"])
    cfg = parse_run_config(["--model_name", str(family_dir("llama")), "--use_peft", "--lora_router"])
    from leantune.models.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="--lora_router: LlamaForCausalLM has no router"):
        run_model_facts(cfg.model).check_lora_targets(cfg.peft)
    llama4 = parse_run_config(["--model_name", str(moe_dir("llama4")), "--use_peft", "--lora_router",
                               "--lora_dropout", "0"])
    with pytest.raises(ModelLoadError, match="--lora_router: Llama4ForCausalLM's router returns its scores with its "
                                             "logits"):
        run_model_facts(llama4.model).check_lora_targets(llama4.peft)


# ------------------------------------------------------------------- the experts' forward, and LoRA's path apart
def _loss_and_grads(model, loss_model, ids, labels):
    loss = loss_model(ids, labels) / count_targets(labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _close(ours, theirs):
    (loss, grads), (own_loss, own_grads) = ours, theirs
    assert loss == pytest.approx(own_loss, rel=1e-5)
    assert grads.keys() == own_grads.keys()
    # relative in norm, float32: the loss within 1e-5; a gradient, which crosses both layers' experts summed in
    # another order (grouped rows against a merged tensor), within 2e-5
    for name, grad in own_grads.items():
        assert float((grads[name] - grad).norm()) <= 2e-5 * max(float(grad.norm()), 1e-6), name


def _transformers_own_experts(model) -> None:
    model.config._experts_implementation = "eager"
    for module in model.modules():  # Llama 4's: its block's and experts' forwards were replaced on the instances
        if type(module).__name__ in ("Llama4TextMoe", "Llama4TextExperts"):
            del module.forward


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_leantunes_experts_forward_is_transformers_eager_one(moe_dir, family):
    """Full fine-tuning: the grouped experts (and their weights' gradients) equal transformers' own loop (Llama 4's:
    its every expert over every token, the unchosen scaled to zero)."""
    _, model, loss_model = _built(moe_dir(family))
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    ours = _loss_and_grads(model, loss_model, ids, labels)
    _transformers_own_experts(model)
    _close(ours, _loss_and_grads(model, loss_model, ids, labels))


def test_llama4s_experts_see_only_their_own_tokens(moe_dir):
    """transformers runs every Llama 4 expert over every token; leantune's block gives each expert its routed rows
    only (tokens x top-k in all), and holds fewer bytes at its peak for it."""
    from leantune.memory.tracker import StorageTracker

    _, model, _ = _built(moe_dir("llama4"))
    block = model.model.layers[0].feed_forward
    rows = []
    block.experts.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    hidden = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    peaks = []
    for own in (False, True):
        if own:
            _transformers_own_experts(model)
        with StorageTracker() as tracker:
            block(hidden)
        peaks.append(tracker.peak_bytes)
    assert rows == [2 * 12 * model.config.num_experts_per_tok, 2 * 12 * model.config.num_local_experts]
    assert peaks[0] < peaks[1]


def _moe_block(model):
    from leantune.models.moe import expert_tensor_targets

    layer = model.get_base_model().model.layers[0]
    block = getattr(layer, "mlp", None) or layer.feed_forward
    wrapper = block.experts
    assert type(wrapper).__name__ == "ParamWrapper" and expert_tensor_targets(block)
    return block, wrapper


def _block_output_and_grads(model, block, hidden):
    hidden = hidden.clone().requires_grad_(True)
    out = block(hidden)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), hidden.grad, grads


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_lora_apart_equals_pefts_parameter_lora(moe_dir, family):
    """One layer's experts with the same routing: leantune's low-rank path apart against peft's own forward
    (its parametrization, W + scale·B·A, through transformers' eager experts) in float32; and the whole loss."""
    _, model, loss_model = _lora(moe_dir(family), "all-linear")
    block, wrapper = _moe_block(model)
    hidden = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ours = _block_output_and_grads(model, block, hidden)
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    our_loss = float(loss_model(ids, labels).detach()) / count_targets(labels)
    del wrapper.forward  # peft's own ParamWrapper.forward again
    experts, _ = _experts_of(wrapper)
    if hasattr(experts, "has_gate"):
        model.config._experts_implementation = "eager"
    else:  # Llama 4's block and experts: transformers' own forward (every expert over every token)
        del experts.forward, block.forward
    theirs = _block_output_and_grads(model, block, hidden)
    for mine, own in zip(ours[:2], theirs[:2]):  # the output and its input's gradient, relative in norm
        assert float((mine - own).norm()) <= 1e-5 * float(own.norm())
    assert ours[2].keys() == theirs[2].keys() and any("experts" in n and "lora_B" in n for n in ours[2])
    for name, grad in theirs[2].items():
        assert float((ours[2][name] - grad).norm()) <= 1e-5 * float(grad.norm()), name
    their_loss = float(loss_model(ids, labels).detach()) / count_targets(labels)
    assert our_loss == pytest.approx(their_loss, rel=1e-5)


def test_expert_lora_builds_no_merged_weight_and_frozen_experts_no_gradient(moe_dir, monkeypatch):
    """peft's parametrization (which builds W + scale·B·A) never runs, nor a frozen expert tensor's gradient."""
    from peft.tuners.lora.layer import ParamWrapper

    import leantune.models.experts as experts

    weight_grads = []
    monkeypatch.setattr(ParamWrapper, "_activate_lora", lambda *_a: pytest.fail("peft merged an expert tensor"))
    original = experts.grouped_mm_weight_grad
    monkeypatch.setattr(experts, "grouped_mm_weight_grad",
                        lambda *a: weight_grads.append(original(*a)) or weight_grads[-1])
    _, model, loss_model = _lora(moe_dir("qwen3_moe"), "all-linear")
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss_model(ids, labels).backward()
    assert weight_grads and all(2 in g.shape[1:] for g in weight_grads)  # the rank-2 factors' only
    assert all(p.grad is None for n, p in model.named_parameters() if "experts" in n and "lora_" not in n)
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n and "lora_" in n)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_moe_plan_equals_the_real_steps_count(moe_dir, family):
    from leantune.planning.fake_step import trace_step

    cfg = parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "all-linear", "--batch_size_training", "2",
                            "--context_length", "64"])
    config = run_model_facts(cfg.model).config
    for mode in ("none", "full"):
        predicted, measured = trace_step(cfg, config, CPU, mode), trace_step(cfg, config, CPU, mode, fake=False)
        assert predicted.peak_bytes == measured.peak_bytes
        assert predicted.breakdown == measured.breakdown
        assert predicted.flops == measured.flops > 0


def test_pytorchs_grouped_kernel_takes_the_low_rank_factors_as_the_loop_does(moe_dir, monkeypatch):
    """The GPU's path (``F.grouped_mm``, bfloat16) forced on the CPU: peft's B is a permuted view and the kernel
    wants unit strides and 16-byte rows; the result is the loop's (within bfloat16)."""
    import leantune.models.experts as experts

    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    _, model, _ = _lora(moe_dir("qwen3_moe"), "gate_up_proj", "down_proj", rank="8")
    model.to(torch.bfloat16)
    block, _ = _moe_block(model)
    hidden = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    looped = _block_output_and_grads(model, block, hidden)
    native = []
    monkeypatch.setattr(experts, "_native", lambda x, w: native.append(1) or (
        w.dtype == torch.bfloat16 and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0))
    monkeypatch.setattr(experts, "_loop", lambda *a: pytest.fail("looped"))  # rank 8: every matmul the kernel's
    kernel = _block_output_and_grads(model, block, hidden)
    assert native
    assert float((kernel[0] - looped[0]).float().norm()) <= 2e-2 * float(looped[0].float().norm())


def test_accumulated_and_validation_router_losses_and_perplexity_of_the_cross_entropy(moe_dir, tmp_path, write_jsonl):
    """Two batches a step: the logged router loss is the token-weighted mean of both batches' (not the last one's);
    validation counts real tokens only; the perplexities are those of the cross-entropy alone."""
    import math

    from leantune.builders.loaders import RunData
    from leantune.models.loading import load_tokenizer

    import shutil

    path = tmp_path / "strong_router"  # a coefficient that makes the router's term visible beside rounding
    shutil.copytree(moe_dir("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.5}))
    # all lengths differ
    texts = [{"text": "The quick brown fox jumps over the lazy dog." + " Again." * i} for i in range(8)]
    data = write_jsonl(texts)
    argv = ["--model_name", str(path), "--output_router_logits", "--dataset", "custom_dataset", "--data_path",
            str(data), "--context_length", "128", "--batching_strategy", "padding", "--batch_size_training", "2",
            "--gradient_accumulation_steps", "2", "--max_train_step", "2", "--num_epochs", "1", "--val_fraction",
            "0.25", "--val_batch_size", "2", "--num_workers_dataloader", "0", "--save_metrics", "--save_model", "false",
            "--attn_implementation", "sdpa", "--lr", "1e-12", "--output_dir", str(tmp_path / "out")]
    lines: list[str] = []
    summary = finetuning.run(parse_run_config(argv), log=lines.append)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    cfg = parse_run_config(argv)
    train, val = RunData(cfg.data, cfg.training, load_tokenizer(cfg.model),
                         log=lambda _line: None).loaders(cfg.training)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    coefficient = model.config.router_aux_loss_coef

    def own(batch):
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                        output_router_logits=True)
        return float(out.loss), float(out.aux_loss), count_targets(batch["labels"])

    window = [own(batch) for batch in list(train)[:2]]  # step 1 trains from the saved weights
    targets = sum(t for _, _, t in window)
    step = metrics["train_steps"][0]
    assert step["router_loss"] == pytest.approx(sum(a * t for _, a, t in window) / targets, rel=1e-5)
    assert step["loss"] == pytest.approx(sum(loss * t for loss, _, t in window) / targets, rel=1e-5)
    assert step["router_term"] == pytest.approx(coefficient * step["router_loss"], rel=1e-9)
    validation = [own(batch) for batch in val]
    val_targets = sum(t for _, _, t in validation)
    val_loss = sum(loss * t for loss, _, t in validation) / val_targets
    val_router = sum(coefficient * a * t for _, a, t in validation) / val_targets
    last = summary["epochs"][-1] if "epochs" in summary else metrics["epochs"][-1]
    assert last["val_loss"] == pytest.approx(val_loss, rel=1e-5)
    assert last["val_perplexity"] == pytest.approx(math.exp(val_loss - val_router), rel=1e-5)
    steps = metrics["train_steps"]  # the epoch's perplexity leaves the router's term out too
    targets = sum(s["target_tokens"] for s in steps)
    router = sum(s["router_term"] * s["target_tokens"] for s in steps) / targets
    assert last["train_perplexity"] == pytest.approx(math.exp(last["train_loss"] - router), rel=1e-6)
    assert router > 1e-3  # a term that matters at this coefficient


@pytest.mark.parametrize("family", ROUTED)
def test_an_expert_adapter_merges_as_peft_merges_it_and_generates(moe_dir, family, tmp_path, capsys):
    """``leantune merge`` folds LoRA on the fused expert tensors (and on attention) into the base: the merged model's
    logits equal those of peft's merge_and_unload on the base in float32 (1e-5), and it generates."""
    from peft import PeftModel

    from leantune.use import generate, merge

    out, merged_dir = tmp_path / "run", tmp_path / "merged"
    finetuning.run(parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0",
                                     "--lora_target_modules", "all-linear", "--context_length", "64", "--lr", "1e-2",
                                     "--max_train_step", "2", "--num_epochs", "1", "--run_validation", "false",
                                     "--num_workers_dataloader", "0", "--output_dir", str(out)]), log=lambda _l: None)
    assert json.loads((out / "adapter_config.json").read_text())["target_parameters"]
    assert merge.main([str(out), str(merged_dir)]) == 0
    said = capsys.readouterr().out
    whole = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(moe_dir(family)).parameters())
    assert f"merging the whole model in float32 ({whole / 2**20:,.1f} MiB of host memory)" in said
    assert "merged the adapter's LoRA (attention and experts), in float32 into" in said
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(moe_dir(family), dtype=torch.float32)
        theirs = PeftModel.from_pretrained(base, str(out)).merge_and_unload()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(moe_dir(family), dtype=torch.float32)(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-4  # the adapter changed the model
    assert generate.main(["--model_name", str(merged_dir), "--prompt", "Name three colours.",
                          "--max_new_tokens", "4"]) == 0
    if family == "mixtral":  # --dtype chooses the merged weights' dtype; without it, the base's
        from safetensors import safe_open

        assert merge.main([str(out), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
        with safe_open(next((tmp_path / "bf16").glob("*.safetensors")), "pt") as saved:
            assert {saved.get_tensor(key).dtype for key in saved.keys()} == {torch.bfloat16}
        base_bf16 = tmp_path / "base-bf16"
        AutoModelForCausalLM.from_pretrained(moe_dir(family), dtype=torch.bfloat16).save_pretrained(base_bf16)
        assert merge.main([str(out), str(tmp_path / "onto-bf16"), "--model_name", str(base_bf16)]) == 0
        assert "in bfloat16 into" in capsys.readouterr().out
        with torch.no_grad():  # merged in float32 from the bf16 base, then rounded once
            ours = AutoModelForCausalLM.from_pretrained(tmp_path / "onto-bf16", dtype=torch.float32)(ids).logits
            base = AutoModelForCausalLM.from_pretrained(base_bf16, dtype=torch.float32)
            theirs = PeftModel.from_pretrained(base, str(out)).merge_and_unload().to(torch.bfloat16).float()(ids).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # a merge in bf16 is ~1e-3 off


def test_an_mxfp4_checkpoint_is_refused_in_one_line_naming_the_way_out(moe_dir, tmp_path):
    import shutil

    from leantune.models.loading import ModelLoadError

    path = tmp_path / "mxfp4"
    shutil.copytree(moe_dir("gpt_oss"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ModelLoadError, match=r"already quantized \(mxfp4\), which leantune can neither train from nor "
                                             r"re-quantize; .*Mxfp4Config\(dequantize=True\)"):
        run_model_facts(parse_run_config(["--model_name", str(path)]).model)


# ------------------------------------------------------------------------------------------------ 4-bit experts
def _dequantized_in_place(model) -> None:
    """Every 4-bit expert tensor replaced by its dequantized weights (the reference model)."""
    from leantune.models.quantized_experts import _dequantize, expert_tensors_quantized, quant_state_of

    for module, name in expert_tensors_quantized(model):
        packed = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(_dequantize(packed, quant_state_of(packed)), requires_grad=False)


@pytest.fixture(params=["whole", "one_expert_at_a_time"])
def expert_chunks(request, monkeypatch):
    """The tiny experts dequantized in one chunk (they are far under ``EXPERT_CHUNK_BYTES``), or one at a time."""
    if request.param == "one_expert_at_a_time":
        from leantune.models import quantized_experts

        monkeypatch.setattr(quantized_experts, "EXPERT_CHUNK_BYTES", 1)
    return request.param


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_4bit_experts_equal_a_model_holding_their_dequantized_weights(moe_dir, family, expert_chunks):
    torch.manual_seed(0)
    lines: list[str] = []
    cfg = parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0", "--lora_r", "2",
                            "--lora_target_modules", "all-linear", "--quantization", "4bit"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    quantized = _loss_and_grads(model, loss_model, ids, labels)
    line = next(line for line in lines if "fused expert tensors" in line)
    from leantune.models.quantized_experts import expert_tensors_quantized, quant_state_of

    tensors = [getattr(m, n) for m, n in expert_tensors_quantized(model)]
    assert len(tensors) == 4 and all(t.dtype == torch.uint8 for t in tensors)  # two layers, two tensors each
    weights = sum(quant_state_of(t).shape.numel() for t in tensors)
    assert f"{weights / 1e6:,.2f}M weights, in 4-bit (nf4 blocks of 64 within each expert, double quantization)" in line

    def held(t):  # the packed bytes, the blocks' scales (8-bit, double quantized) and both code books
        state = quant_state_of(t)
        parts = [t, state.absmax, state.code, state.state2.absmax, state.state2.code]
        return sum(p.numel() * p.element_size() for p in parts)

    total = sum(held(t) for t in tensors)
    assert line.startswith("quantization: 4 fused expert tensors, ") and \
        f": {total / 2**20:,.1f} MiB, {total / (weights * 2):.3f} of their bfloat16 bytes;" in line
    cap = "256 MiB" if expert_chunks == "whole" else "0 MiB"  # one expert a chunk: a cap of 1 byte
    assert line.endswith(f"; dequantized at most {cap} of experts at a time for each matmul and again in backward, "
                         "never kept; quantized as they loaded (one layer's 16-bit experts on the device at a time)")
    _dequantized_in_place(model)
    _close(quantized, _loss_and_grads(model, loss_model, ids, labels))
    assert any("experts" in n and "lora_B" in n for n in quantized[1])


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_4bit_experts_keep_no_dequantized_tensor_for_backward(moe_dir, family):
    cfg = parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "all-linear", "--quantization", "4bit"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    from leantune.models.quantized_experts import expert_tensors_quantized, quant_state_of

    shapes = {tuple(quant_state_of(getattr(m, n)).shape) for m, n in expert_tensors_quantized(model)}
    sizes = {torch.Size(s).numel() for s in shapes}
    saved = []
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = loss_model(ids, labels)
    assert not [t for t in saved if t.is_floating_point() and t.numel() in sizes]  # only packed bytes are kept
    loss.backward()


def _packed_experts(full: torch.Tensor, double: bool) -> torch.nn.Parameter:
    import bitsandbytes as bnb

    packed, state = bnb.functional.quantize_4bit(full, blocksize=64, compress_statistics=double, quant_type="nf4",
                                                 quant_storage=torch.uint8)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    weight.quant_state = state
    return weight


@pytest.mark.parametrize("double", [True, False], ids=["double_quant", "plain_scales"])
def test_a_4bit_expert_tensor_is_dequantized_a_chunk_at_a_time(monkeypatch, double):
    """The rows through a 4-bit tensor equal each expert's rows times its dequantized weight; only chunks with rows
    are dequantized, the last one cut at the tensor's end; and with fewer experts a chunk fewer are alive at once
    (counted by the planner's tracker, whatever the routing)."""
    import bitsandbytes as bnb

    from leantune.memory.tracker import StorageTracker
    from leantune.models import quantized_experts
    from leantune.models.experts import grouped_mm  # noqa: F401  (registers leantune::grouped_mm)

    generator = torch.Generator().manual_seed(5)
    weight = _packed_experts(torch.randn(8, 64, 128, generator=generator), double)
    dequantized = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    counts = torch.tensor([5, 0, 3, 9, 1, 0, 4, 2])
    offsets, x = counts.cumsum(0), torch.randn(int(counts.sum()), 64, generator=generator, requires_grad=True)
    expected = torch.cat([x[a:b] @ dequantized[e] for e, (a, b) in enumerate(zip([0, *offsets[:-1]], offsets))])
    made, real = [], quantized_experts._experts_dequantized
    monkeypatch.setattr(quantized_experts, "_experts_dequantized",
                        lambda *args: made.append(args[6:8]) or real(*args))  # (start, stop)
    expert, peaks, chunks = 64 * 128 * 4, {}, {}
    for chunk_bytes in (quantized_experts.EXPERT_CHUNK_BYTES, 3 * expert, expert):
        monkeypatch.setattr(quantized_experts, "EXPERT_CHUNK_BYTES", chunk_bytes)
        made.clear()
        out = quantized_experts.dequantized_grouped_mm(x, weight, offsets, transpose=False)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        grad, = torch.autograd.grad(out.square().sum(), x)
        chunks[chunk_bytes] = list(made)
        torch.testing.assert_close(grad, torch.autograd.grad(expected.square().sum(), x, retain_graph=True)[0],
                                   rtol=1e-5, atol=1e-5)
        with StorageTracker() as tracker:
            quantized_experts.dequantized_grouped_mm(x.detach(), weight, offsets, transpose=False)
        peaks[chunk_bytes] = tracker.peak_bytes
    assert list(chunks.values()) == [[(0, 8)] * 2, [(0, 3), (3, 6), (6, 8)] * 2,  # forward, then backward
                                     [(0, 1), (2, 3), (3, 4), (4, 5), (6, 7), (7, 8)] * 2]  # none without rows
    whole, three, one = peaks.values()
    assert (whole - three, whole - one) == (5 * expert, 7 * expert)  # experts' float32 weights fewer alive at once


def test_a_bfloat16_expert_tensor_gives_bfloat16_rows_from_float32_ones():
    from leantune.models import quantized_experts
    from leantune.models.experts import grouped_mm  # noqa: F401

    weight = _packed_experts(torch.randn(2, 64, 64).bfloat16(), True)
    out = quantized_experts.dequantized_grouped_mm(torch.randn(6, 64), weight, torch.tensor([2, 6]), transpose=False)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_4bit_moe_plan_equals_the_real_steps_count(moe_dir, family, expert_chunks):
    from leantune.planning.fake_step import trace_step

    cfg = parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0", "--quantization",
                            "4bit", "--lora_target_modules", "all-linear", "--batch_size_training", "2",
                            "--context_length", "64"])
    config = run_model_facts(cfg.model).config
    predicted, measured = trace_step(cfg, config, CPU, "full"), trace_step(cfg, config, CPU, "full", fake=False)
    assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
    assert predicted.flops == measured.flops


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe"])
def test_4bit_experts_under_half_precision_autocast_on_float32_weights(moe_dir, family):
    """Backward runs outside autocast: its half-precision gradient meets the dequantized weight."""
    cfg = parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "all-linear", "--quantization", "4bit"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
    loss_model = loss_model_for(model, cfg.training, sharded=False)
    ids, labels = make_batch(model.config.vocab_size, seq=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_model(ids, labels) / count_targets(labels)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]  # B starts at 0
    assert grads and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_4bit_experts_follow_quant_type_and_double_quantization_and_count_as_weights(moe_dir):
    from leantune.models.loading import count_parameters
    from leantune.models.quantized_experts import expert_tensors_quantized, quant_state_of

    lines: list[str] = []
    cfg = parse_run_config(["--model_name", str(moe_dir("mixtral")), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "q_proj", "--quantization", "4bit", "--quant_type", "fp4",
                            "--use_double_quant", "false"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    states = [quant_state_of(getattr(m, n)) for m, n in expert_tensors_quantized(model)]
    assert states and all(s.quant_type == "fp4" and not s.nested for s in states)
    line = next(line for line in lines if "fused expert tensors" in line)
    assert "(fp4 blocks of 64 within each expert):" in line
    ratio = float(line.split(" of their bfloat16 bytes")[0].rsplit(", ", 1)[1])
    assert 0.25 < ratio < 0.35  # the packed half-bytes and their per-block scales (scales alone would be 0.25)
    _, total = count_parameters(model)
    dense = AutoModelForCausalLM.from_pretrained(moe_dir("mixtral"), dtype=torch.float32)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert total == sum(p.numel() for p in dense.parameters()) + lora  # two weights a packed byte



def test_what_counts_as_a_mixture_of_experts_and_its_router_loss():
    from leantune.models.moe import expert_count, moe_lora_targets, router_loss_of

    assert expert_count(AutoConfig.for_model("qwen3_moe", num_experts=0)) is None  # a dense Qwen3-MoE config
    assert expert_count(AutoConfig.for_model("llama")) is None
    assert router_loss_of(AutoConfig.for_model("mixtral")) is None  # output_router_logits off
    rule = router_loss_of(AutoConfig.for_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.02))
    assert rule == RouterLoss(num_experts=8, top_k=2, coefficient=0.02)
    composite = AutoConfig.for_model("llama4", text_config=dict(output_router_logits=True, num_local_experts=16,
                                                                 num_experts_per_tok=1))
    assert router_loss_of(composite) == RouterLoss(16, 1, composite.text_config.router_aux_loss_coef)
    from types import SimpleNamespace

    no_top_k = SimpleNamespace(output_router_logits=True, num_local_experts=8, router_aux_loss_coef=0.02)
    assert router_loss_of(no_top_k) is None  # no top-k: no term leantune can compute (the check then refuses)
    assert moe_lora_targets(["q_proj"], ["q_proj"], {}, ([], []), all_linear=False, router=False) is None  # dense


def test_the_grouped_kernel_is_taken_only_where_it_runs():
    from leantune.models.experts import kernel_fits

    shape = torch.Size([4, 64, 16])
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    assert kernel_fits("cuda", torch.bfloat16, shape)
    assert not kernel_fits("cpu", torch.bfloat16, shape)
    assert not kernel_fits("cuda", torch.float32, shape) and not kernel_fits("cuda", torch.float16, shape)
    assert not kernel_fits("cuda", torch.bfloat16, torch.Size([4, 64, 4]))  # 8-byte rows (a rank-4 factor)
    assert not kernel_fits("cuda", torch.bfloat16, torch.Size([4, 12, 16]))


def test_the_grouped_matmuls_flops_are_counted():
    """2 x rows x in x out for the forward; the weight's gradient as much again; none for a frozen weight."""
    from torch.utils.flop_counter import FlopCounterMode

    from leantune.models.experts import grouped_mm

    x = torch.randn(10, 6, requires_grad=True)
    offsets = torch.tensor([3, 3, 10])
    for trains in (False, True):
        weight = torch.randn(3, 6, 5, requires_grad=trains)
        with FlopCounterMode(display=False) as counter:
            grouped_mm(x, weight, offsets).sum().backward()
        # forward, the input's gradient (the same matmul transposed), and the weight's when it trains
        assert counter.get_total_flops() == 2 * 10 * 6 * 5 * (3 if trains else 2)


@pytest.mark.parametrize("transpose", [False, True])
def test_the_4bit_grouped_operator_has_the_shape_and_dtype_on_meta_tensors(transpose):
    """What a compiled or meta-device trace gets (its fake implementation): the rows by the oriented tensor's
    outputs."""
    from leantune.models import quantized_experts  # noqa: F401  (registers leantune::grouped_mm_4bit)

    meta = torch.device("meta")
    out = torch.ops.leantune.grouped_mm_4bit(torch.empty(10, 96 if transpose else 64, device=meta),
                                             torch.empty(4 * 64 * 96 // 2, 1, dtype=torch.uint8, device=meta),
                                             torch.empty(4 * 96, device=meta), torch.empty(4, dtype=torch.long,
                                                                                           device=meta),
                                             [4, 64, 96], 64, "nf4", torch.bfloat16, transpose)
    assert out.shape == (10, 64 if transpose else 96) and out.dtype == torch.bfloat16 and out.is_meta


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_4bit_experts_are_quantized_as_they_load_and_train_as_those_quantized_after_loading(moe_dir, family,
                                                                                              monkeypatch):
    """No 16-bit expert tensor is left in the loaded model (each was packed the moment transformers set it), peft
    still sees their 3-D shapes, and the loss and every gradient equal those of experts quantized after LoRA."""
    import contextlib

    import leantune.builders.model as builder
    from leantune.models.moe import expert_parameters

    real_load, left = builder.load_model, []
    monkeypatch.setattr(builder, "load_model", lambda *a, **k: (lambda m: left.append(
        [n for n, _, _, p in expert_parameters(m) if p.dim() == 3]) or m)(real_load(*a, **k)))
    results = []
    for as_loaded in (True, False):
        if not as_loaded:  # the path before: the experts load in 16 bits and are quantized after LoRA
            monkeypatch.setattr(builder, "experts_quantized_as_loaded", lambda _quant: contextlib.nullcontext())
        cfg = parse_run_config(["--model_name", str(moe_dir(family)), "--use_peft", "--lora_dropout", "0",
                                "--lora_target_modules", "all-linear", "--quantization", "4bit"])
        torch.manual_seed(0)
        lines = []
        model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
        ids, labels = make_batch(model.config.vocab_size, seq=24)
        results.append((*_loss_and_grads(model, loss_model_for(model, cfg.training, sharded=False), ids, labels),
                        "quantized as they loaded" in "\n".join(lines)))
    (loss, grads, said), (after_loss, after_grads, said_after) = results
    assert left[0] == [] and left[1]  # 16-bit experts in the loaded model only on the path before
    assert said and not said_after
    assert loss == after_loss and grads.keys() == after_grads.keys()
    assert all(torch.equal(grads[n], after_grads[n]) for n in grads)
    assert any("experts" in n and "lora_A" in n for n in grads)


def test_expert_tensors_the_checkpoint_lacks_are_initialised_not_packed_as_they_load(moe_dir, tmp_path):
    """transformers makes a missing tensor with empty memory and initialises it after setting it: packing it the
    moment it is set would pack that memory. It is quantized after LoRA instead, from its initialised values."""
    import shutil

    from safetensors.torch import load_file, save_file

    from leantune.models.quantized_experts import LOADED_QUANTIZED, _dequantize, quant_state_of

    source, copy = moe_dir("qwen3_moe"), tmp_path / "lacking"
    shutil.copytree(source, copy)
    weights = load_file(copy / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.0.mlp.experts" not in k}, copy / "model.safetensors",
              metadata={"format": "pt"})
    cfg = parse_run_config(["--model_name", str(copy), "--use_peft", "--lora_dropout", "0", "--lora_target_modules",
                            "all-linear", "--quantization", "4bit"])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    from leantune.models.quantized_experts import expert_tensors_quantized

    assert "quantized as they loaded" not in "\n".join(lines)  # not all of them were
    experts = {f"{id(m)}.{n}": (".layers.0." in _name_of(model, m), getattr(m, n))
               for m, n in expert_tensors_quantized(model)}
    assert len(experts) == 4
    for first_layer, weight in experts.values():
        assert getattr(weight, LOADED_QUANTIZED, False) != first_layer
        assert float(_dequantize(weight.data, quant_state_of(weight)).float().std()) < 1.0  # initialised values


def _name_of(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def test_a_host_kept_tensors_chunk_is_copied_before_it_is_dequantized():
    """With ``host`` the chunk's packed bytes are a new tensor on the scales' device (the copy a GPU receives, which
    the planner counts), not a view of the host's."""
    from leantune.memory.tracker import StorageTracker
    from leantune.models import quantized_experts

    weight = _packed_experts(torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(8)), True)
    scales = quantized_experts._block_scales(*(lambda s, n: (s, *n))(*quantized_experts._scale_inputs(
        weight.quant_state)))
    peaks, outs = [], []
    for host in (False, True):
        with StorageTracker() as tracker:
            outs.append(quantized_experts._experts_dequantized(weight, scales, [4, 64, 128], 64, "nf4", torch.float32,
                                                               1, 3, False, host))
        peaks.append(tracker.peak_bytes)
    assert torch.equal(*outs)
    assert peaks[1] - peaks[0] == 2 * 64 * 128 // 2  # two experts' packed bytes, copied


def test_the_start_up_line_counts_host_kept_experts_in_mib():
    from leantune.memory.tracker import ON_HOST
    from leantune.models.quantized_experts import describe_quantized_experts

    experts = torch.nn.Module()
    experts.gate_up_proj = _packed_experts(torch.randn(4, 512, 1024), True)  # 2M weights: 1 MiB packed
    setattr(experts.gate_up_proj, ON_HOST, True)
    model = torch.nn.Module()
    model.experts = experts
    line = describe_quantized_experts(model)
    assert "; 1 of them (1.0 MiB) kept in host memory (--offload_experts)" in line


def test_transformers_allocator_warm_up_is_skipped_while_experts_load_and_put_back_after(moe_dir, monkeypatch):
    """The warm-up would reserve the 16-bit experts' bytes on a GPU for the whole run."""
    import transformers.modeling_utils as hf_modeling

    calls = []

    def warm_up(*_args, **_kwargs):
        calls.append(1)

    monkeypatch.setattr(hf_modeling, "caching_allocator_warmup", warm_up)
    cfg = parse_run_config(["--model_name", str(moe_dir("mixtral")), "--use_peft", "--lora_dropout", "0",
                            "--quantization", "4bit"])
    build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lambda _line: None)
    assert calls == [] and hf_modeling.caching_allocator_warmup is warm_up


def test_tiles_leave_the_experts_block_whole_and_the_loss_unchanged(moe_dir):
    """--tiled_mlp tiles a mixture of experts' norms, never its experts block (its router's logits are collected
    once a layer, and it reads its input whole): the loss, the router's term included, is the untiled one."""
    from leantune.models.tiled_mlp import tiled_modules

    losses = []
    for tiles in ("off", "8"):
        cfg = parse_run_config(["--model_name", str(moe_dir("qwen3_moe")), "--output_router_logits", "--tiled_mlp",
                                tiles, "--context_length", "24"])
        lines = []
        torch.manual_seed(0)
        model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
        ids, labels = make_batch(model.config.vocab_size, seq=24)
        losses.append(float(loss_model_for(model, cfg.training, sharded=False)(ids, labels).detach()))
    layer = model.model.layers[0]
    assert layer.mlp not in tiled_modules(layer) and tiled_modules(layer)  # its norms are
    assert any("norms in tiles of 8 tokens" in line and "experts block runs whole" in line for line in lines)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_the_longest_context_is_searched_for_a_mixture_of_experts(moe_dir):
    from leantune.planning.max_context import find_max_context

    cfg = parse_run_config(["--model_name", str(moe_dir("qwen3_moe")), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "all-linear"])
    config = run_model_facts(cfg.model).config
    search = find_max_context(cfg, config, CPU, 64 << 20)
    assert search.max_context > 0


def test_auto_checkpointing_chooses_a_mode_that_fits_for_a_mixture_of_experts(moe_dir):
    from leantune.planning.choose import choose_auto_mode
    from leantune.planning.context import PlanContext

    cfg = parse_run_config(["--model_name", str(moe_dir("qwen3_moe")), "--use_peft", "--lora_dropout", "0",
                            "--lora_target_modules", "all-linear", "--enable_activation_checkpointing",
                            "--activation_checkpointing_mode", "auto", "--context_length", "256"])
    config = run_model_facts(cfg.model).config
    lines = []
    unbounded, plan = choose_auto_mode(PlanContext(config, CPU, 1 << 40, None, lines.append), cfg)
    assert plan.mode == "none" and plan.peak_bytes < 1 << 40  # all fit: the least recompute
    tight, fitted = choose_auto_mode(PlanContext(config, CPU, plan.peak_bytes - 1, None, lines.append), cfg)
    assert fitted.mode != "none" and fitted.peak_bytes < plan.peak_bytes
