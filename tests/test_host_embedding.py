"""``--offload_embedding``: the frozen input embedding kept in host memory, counted off the device by the planner
and the measured step alike, the same loss; refused where it would train or is tied to the LM head."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from leantune.builders.model import build_model
from leantune.builders.step import loss_model_for
from leantune.cli_args import parse_run_config
from leantune.config import ConfigError
from leantune.models.facts import run_model_facts
from leantune.models.structure import unwrap_model
from leantune.precision import choose_precision

CPU = torch.device("cpu")
LORA = ["--use_peft", "--lora_dropout", "0", "--lora_target_modules", "all-linear"]


def _loss_and_log(path, *flags):
    cfg = parse_run_config(["--model_name", str(path), *LORA, *flags])
    lines = []
    model, _ = build_model(cfg, choose_precision(cfg, CPU), log=lines.append)
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
    cfg = parse_run_config(["--model_name", str(moe_dir("gpt_oss")), *LORA, "--offload_embedding"])
    model, _ = build_model(cfg, choose_precision(cfg, torch.device("cuda")), log=lambda _line: None)
    embedding = unwrap_model(model).get_input_embeddings()
    assert embedding.weight.device.type == "cpu"
    rows = embedding(torch.tensor([[1, 2, 3]], device="cuda"))
    assert rows.device.type == "cuda"
    ids, labels = make_batch(unwrap_model(model).config.vocab_size, seq=24)
    loss = loss_model_for(model, cfg.training, sharded=False)(ids.cuda(), labels.cuda())
    loss.backward()
    assert embedding.weight.device.type == "cpu" and embedding.weight.grad is None
