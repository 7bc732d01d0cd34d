"""Weights kept in host memory while the rest trains on the device: ``--offload_embedding`` (the frozen input
embedding) and ``--offload_experts N`` (the 4-bit experts of N layers). Each is counted off the device by the planner
and the measured step alike, gives the same loss, and is refused where it cannot hold."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from leantune.builders.model import build_model
from leantune.builders.loss_and_optimizer import loss_model_for
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.models.facts import run_model_facts
from leantune.model_structure import unwrap_model
from leantune.precision import choose_precision

CPU = torch.device("cpu")
LORA = ["--use_peft", "--lora_dropout", "0", "--lora_target_modules", "all-linear"]


def _loss_and_log(path, *flags):
    cfg = parse_run_config(["--model_name", str(path), *LORA, *flags])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    ids, labels = make_batch(unwrap_model(model).config.vocab_size, seq=24)
    return float(loss_model_for(model, cfg.training, sharded=False)(ids, labels).detach()), lines, model


def test_the_loss_is_unchanged_and_the_start_up_log_says_where_the_embedding_is(moe_dir):
    loss, lines, _ = _loss_and_log(moe_dir("gpt_oss"))
    host_loss, host_lines, model = _loss_and_log(moe_dir("gpt_oss"), "--offload_embedding")
    assert host_loss == loss
    embedding = unwrap_model(model).get_input_embeddings()
    mib = embedding.weight.numel() * embedding.weight.element_size() / 2**20
    assert f"embedding: kept in host memory (--offload_embedding; {mib:,.1f} MiB not on the device)" in "\n".join(
        host_lines)
    assert not any(line.startswith("embedding:") for line in lines)


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_the_plan_holds_the_embedding_off_the_device_and_equals_the_measured_step(moe_dir, family):
    from leantune.planning.fake_step import trace_step

    steps = {}
    for flags in ([], ["--offload_embedding"]):
        cfg = parse_run_config(["--model_name", str(moe_dir(family)), *LORA, "--batch_size_training", "2",
                                "--context_length", "64", *flags])
        config = run_model_facts(cfg.model).config
        predicted, measured = trace_step(cfg, config, CPU, "full"), trace_step(cfg, config, CPU, "full", fake=False)
        assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
        steps[bool(flags)] = predicted
    embedding_bytes = config.vocab_size * config.hidden_size * 4  # float32 weights on the CPU
    assert steps[False].breakdown["parameter"] - steps[True].breakdown["parameter"] == embedding_bytes
    assert steps[True].host_state_bytes == (embedding_bytes, 0) and steps[False].host_state_bytes == (0, 0)


@pytest.mark.parametrize("flags, message", [
    ([], "--offload_embedding: keeps a frozen embedding on the host and needs --use_peft"),
    (["--use_peft", "--enable_fsdp"], "--offload_embedding: not with --enable_fsdp"),
])
def test_a_run_that_trains_or_shards_the_embedding_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(["--offload_embedding", *flags])


def test_tied_embeddings_and_a_trainable_embedding_are_refused(tmp_path, moe_dir):
    from leantune.models.host_embedding import offload_embedding
    from leantune.models.tiny import make_tiny_model

    tied = make_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="ties its input embedding to its LM head"):
        _loss_and_log(tied, "--offload_embedding")
    _, _, model = _loss_and_log(moe_dir("gpt_oss"))
    unwrap_model(model).get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(ConfigError, match="the input embedding trains in this run"):
        offload_embedding(unwrap_model(model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_embedding_stays_on_the_host_and_its_rows_reach_the_gpu(moe_dir):
    losses = []
    for flags in ([], ["--offload_embedding"]):
        cfg = parse_run_config(["--model_name", str(moe_dir("gpt_oss")), *LORA, *flags])
        torch.manual_seed(0)
        model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cuda")),
                               log=lambda _line: None)
        ids, labels = make_batch(unwrap_model(model).config.vocab_size, seq=24)
        loss = loss_model_for(model, cfg.training, sharded=False)(ids.cuda(), labels.cuda())
        loss.backward()
        losses.append(float(loss.detach()))
    embedding = unwrap_model(model).get_input_embeddings()
    assert embedding.weight.device.type == "cpu" and embedding.weight.grad is None
    assert embedding(torch.tensor([[1, 2, 3]], device="cuda")).device.type == "cuda"
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


# ------------------------------------------------------------------------------------------ --offload_experts
QLORA = [*LORA, "--quantization", "4bit"]


def _expert_loss_and_grads(path, *flags):
    cfg = parse_run_config(["--model_name", str(path), *QLORA, *flags])
    lines = []
    torch.manual_seed(0)  # the same LoRA pairs
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, CPU), log=lines.append)
    ids, labels = make_batch(unwrap_model(model).config.vocab_size, seq=24)
    loss = loss_model_for(model, cfg.training, sharded=False)(ids, labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, lines, model


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_experts_kept_on_the_host_give_the_same_loss_and_gradients(moe_dir, family):
    from leantune.memory.tracker import ON_HOST

    loss, grads, _, _ = _expert_loss_and_grads(moe_dir(family))
    host_loss, host_grads, lines, model = _expert_loss_and_grads(moe_dir(family), "--offload_experts", "1")
    assert host_loss == loss and host_grads.keys() == grads.keys()
    assert all(torch.equal(host_grads[n], g) for n, g in grads.items())
    kept = [n for n, p in model.named_parameters() if getattr(p, ON_HOST, False)]
    assert kept and all(".layers.0." in n for n in kept)  # the first layer's two expert tensors
    assert len(kept) == 2
    line = next(line for line in lines if line.startswith("quantization: ") and "fused expert" in line)
    mib = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in kept) / 2**20
    assert f"; 2 of them ({mib:,.1f} MiB) kept in host memory (--offload_experts)" in line


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_plan_holds_the_experts_off_the_device_and_equals_the_measured_step(moe_dir, family):
    from leantune.planning.fake_step import trace_step

    steps = {}
    for layers in ("0", "2"):
        cfg = parse_run_config(["--model_name", str(moe_dir(family)), *QLORA, "--batch_size_training", "2",
                                "--context_length", "64", "--offload_experts", layers])
        config = run_model_facts(cfg.model).config
        predicted, measured = trace_step(cfg, config, CPU, "full"), trace_step(cfg, config, CPU, "full", fake=False)
        assert predicted.peak_bytes == measured.peak_bytes and predicted.breakdown == measured.breakdown
        steps[layers] = predicted
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    packed = 2 * experts * 3 * config.hidden_size * inner // 2  # two layers' gate-up and down tensors, 4 bits
    assert steps["0"].breakdown["parameter"] - steps["2"].breakdown["parameter"] == packed
    assert steps["2"].host_state_bytes == (packed, 0)  # on the CPU: not pinned (a GPU's pinned bytes are rounded)
    # the peak drops too: the bytes copied over are one chunk at a time (the whole tensor at these tiny shapes)
    assert steps["0"].peak_bytes - steps["2"].peak_bytes >= packed // 2


@pytest.mark.parametrize("flags, message", [
    (["--offload_experts", "1"], "--offload_experts: keeps 4-bit expert tensors in host memory: it needs "
                                 "--quantization 4bit on one GPU"),
    (["--offload_experts", "-1"], "--offload_experts: a number of layers, 0 or more"),
])
def test_offloaded_experts_without_4bit_experts_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(["--use_peft", *flags])


@pytest.mark.parametrize("family, layers, message", [
    ("qwen3_moe", "9", "--offload_experts 9: this model has 2 layers of experts; at most 2"),
])
def test_more_layers_than_the_model_has_are_refused(moe_dir, family, layers, message):
    with pytest.raises(ConfigError, match=message):
        _expert_loss_and_grads(moe_dir(family), "--offload_experts", layers)


def test_a_model_without_experts_is_refused(family_dir):
    with pytest.raises(ConfigError, match="--offload_experts: this model has no 4-bit expert tensors"):
        _expert_loss_and_grads(family_dir("llama"), "--offload_experts", "1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_kept_experts_are_pinned_host_memory_and_the_loss_is_unchanged(moe_dir):
    from leantune.memory.tracker import ON_HOST

    losses = []
    for flags in ([], ["--offload_experts", "1"]):
        cfg = parse_run_config(["--model_name", str(moe_dir("qwen3_moe")), *QLORA, *flags])
        model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cuda")),
                               log=lambda _line: None)
        ids, labels = make_batch(unwrap_model(model).config.vocab_size, seq=24)
        loss = loss_model_for(model, cfg.training, sharded=False)(ids.cuda(), labels.cuda())
        loss.backward()
        losses.append(float(loss.detach()))
    kept = [p for p in model.parameters() if getattr(p, ON_HOST, False)]
    assert kept and all(p.device.type == "cpu" and p.is_pinned() for p in kept)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_the_hooks_move_the_ids_to_the_host_and_the_rows_to_the_models_device():
    from leantune.models.host_embedding import ids_to_host, rows_to

    ids = torch.tensor([[1, 2]])
    args, kwargs = ids_to_host(None, (ids, "more"), {})
    assert args[0].device.type == "cpu" and args[1:] == ("more",) and kwargs == {}
    args, kwargs = ids_to_host(None, (), {"input": ids})  # as a keyword too
    assert args == () and list(kwargs) == ["input"] and kwargs["input"].device.type == "cpu"
    rows = torch.zeros(1, 2, 4)
    assert rows_to(torch.device("meta"), None, (ids,), rows).device.type == "meta"


def test_the_rows_go_where_the_rest_of_the_model_is(moe_dir):
    """The rest of the model on another device (meta here, a GPU in a run): the embedding stays on the host with
    both hooks on it, and its rows come out on that device."""
    from transformers import AutoModelForCausalLM

    from leantune.models.host_embedding import offload_embedding

    model = AutoModelForCausalLM.from_pretrained(moe_dir("gpt_oss"), dtype=torch.float32)
    embedding = model.get_input_embeddings().requires_grad_(False)
    for module in (model.model.layers, model.model.norm, model.lm_head):
        module.to("meta")
    offload_embedding(model)
    assert embedding.weight.device.type == "cpu" and len(embedding._forward_pre_hooks) == 1
    assert embedding(torch.tensor([[1, 2]])).device.type == "meta"
