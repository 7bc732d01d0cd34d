"""Packing that keeps examples apart: rows, per-example losses equal to alone, the run's check, the plan's mask."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from leantune import finetuning
from leantune.flags import parse_run_config
from leantune.config import ConfigError, DataConfig
from leantune.data import IGNORE_INDEX, build_datasets, make_dataloader, make_rows
from leantune.data.packing import best_fit_rows, fit_to_context, full_rows_batch
from leantune.labels import shifted_targets
from leantune.precision import Precision
from leantune.training.packing_check import check_examples_kept_apart
from leantune.training.step import CausalLMLoss, forward_hidden

from conftest import FAMILY_SHAPE
from helpers import assert_near

FLOAT32 = Precision(torch.device("cpu"), torch.float32, None, False, "float32")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "cohere"]


def test_best_fit_puts_every_example_in_one_row_within_the_context():
    lengths = [7, 3, 9, 1, 5, 5, 2, 8, 4, 6]
    rows = best_fit_rows(lengths, context_length=10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 5  # 50 tokens in rows of 10: no row wasted
    assert best_fit_rows(lengths, 10) == rows  # the same lengths, the same rows


def test_rows_restart_positions_and_mask_each_examples_first_label():
    examples = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "_source": "a:1"},
                {"input_ids": [4, 5], "labels": [4, 5], "_source": "a:2"}]
    rows, fitting = make_rows(examples, strategy="packing", context_length=8, pad_id=0)
    assert fitting.note(8, "truncate") is None and len(rows) == 1
    row = rows[0]
    assert row["input_ids"] == [1, 2, 3, 4, 5, 0, 0, 0]
    assert row["position_ids"] == [0, 1, 2, 0, 1, 0, 1, 2]  # the padding is a span of its own
    # 4 is never a target alone (nothing predicts a first token): not after 3 either
    assert row["labels"] == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5] + [IGNORE_INDEX] * 3
    assert row["attention_mask"] == [1] * 5 + [0] * 3 and row["sources"] == ["a:1", "a:2"]


def test_overlong_examples_are_cut_or_dropped_and_counted():
    long = {"input_ids": list(range(1, 11)), "labels": [IGNORE_INDEX] * 2 + list(range(3, 11))}
    short = {"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3]}
    kept, fitting = fit_to_context([long, short], context_length=6)
    assert [len(ex["input_ids"]) for ex in kept] == [6, 3]
    assert (fitting.cut, fitting.targets_lost) == (1, 4)
    assert fitting.note(6, "truncate") == ("1 of 2 examples are longer than --context_length 6: 1 cut to fit "
                                           "(--overlong_examples drop leaves them out); 4 target tokens lost")
    kept, fitting = fit_to_context([long, short], context_length=6, overlong="drop")
    assert len(kept) == 1 and (fitting.dropped_overlong, fitting.targets_lost) == (1, 8)


def per_example_losses(model, batch, positions: bool) -> list[float]:
    """Each example's summed loss in a batch of rows (examples found where the position ids restart)."""
    hidden = forward_hidden(model, batch["input_ids"], batch["position_ids"] if positions else None)
    logits = model.get_output_embeddings()(hidden).float()
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), shifted_targets(batch["labels"]),
                                                   reduction="none")
    losses = []
    for row, starts in zip(token_loss, batch["position_ids"]):
        bounds = [*torch.nonzero(starts == 0).flatten().tolist(), len(starts)]
        losses += [float(row[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    return losses


def alone_losses(model, examples) -> list[float]:
    out = []
    for ex in examples:
        ids, labels = torch.tensor([ex["input_ids"]]), torch.tensor([ex["labels"]])
        logits = model.get_output_embeddings()(forward_hidden(model, ids)).float()
        out.append(float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), shifted_targets(labels),
                                                           reduction="sum")))
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
def test_each_packed_example_has_its_loss_alone(tiny_model_dir, tokenizer, attention):
    train, _ = build_datasets(DataConfig(), tokenizer, seed=0)
    context = 256  # a multiple of 16: see flex below
    rows, _ = make_rows(train[:24], strategy="packing", context_length=context, pad_id=tokenizer.pad_token_id)
    assert len(rows) < 12  # several examples a row
    batch = next(iter(make_dataloader(rows, strategy="packing", batch_size=len(rows), pad_id=0, shuffle=False,
                                      seed=0)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attention)
    # flex's examples alone go through SDPA: PyTorch's compiled CPU flex kernel gets a row wrong at lengths 8 more than
    # a multiple of 16 on some CPUs (measured on an AVX2 EPYC: 8, 24, ..., 120 tokens, one row off by 1.2-2.3; an
    # example alone has any length; the packed rows have the context's). Runs refuse flex on a CPU.
    assert context % 16 == 0
    reference = model if attention != "flex_attention" else AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        packed = per_example_losses(model.eval(), batch, positions=True)
        leaked = per_example_losses(model, batch, positions=False)
        by_source = {ex["_source"]: ex for ex in train[:24]}
        order = [by_source[s] for row in rows for s in row["sources"]]
        alone = alone_losses(reference.eval(), order)
    padding_spans = len(packed) - len(alone)
    packed = [loss for loss in packed if loss != 0.0]  # each row's padding span carries no loss
    assert len(packed) == len(alone) and padding_spans >= 0
    assert packed == pytest.approx(alone, rel=1e-5)
    # what the test would see if examples were not kept apart: concatenation moves them
    assert max(abs(a - b) / b for a, b in zip([v for v in leaked if v != 0.0], alone)) > 1e-3


def test_packed_apart_gradients_equal_the_examples_alone(load_tiny):
    """One example after another in a row trains the weights as the two do in rows of their own."""
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 256, (1, 10), generator=gen), torch.randint(0, 256, (1, 14), generator=gen)
    ids = torch.cat([first, second], 1)
    labels, positions = ids.clone(), torch.cat([torch.arange(10), torch.arange(14)])[None]
    labels[0, 10] = IGNORE_INDEX  # as packing masks an example's first label

    def gradients(loss_of):
        model = load_tiny()
        loss_of(CausalLMLoss(model)).backward()
        return {name: param.grad for name, param in model.named_parameters()}

    packed = gradients(lambda loss: loss(ids, labels, positions))
    alone = gradients(lambda loss: loss(first, first) + loss(second, second))
    for name, grad in packed.items():
        assert_near(grad, alone[name], 1e-5, name)


def test_flash_attention_gets_the_batch_as_one_flat_row():
    """transformers' flash-attention path reads restarting positions as separate sequences only in one row."""
    seen = {}

    def decoder(input_ids, position_ids, use_cache):
        seen["shapes"] = (tuple(input_ids.shape), tuple(position_ids.shape))
        return types.SimpleNamespace(last_hidden_state=torch.zeros(*input_ids.shape, 8))

    decoder.config = types.SimpleNamespace(_attn_implementation="flash_attention_2")
    model = types.SimpleNamespace(get_decoder=lambda: decoder)
    hidden = forward_hidden(model, torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long))
    assert seen["shapes"] == ((1, 48), (1, 48)) and hidden.shape == (3, 16, 8)


def test_the_run_checks_that_its_model_keeps_examples_apart(load_tiny, monkeypatch):
    model = load_tiny()
    for layer in model.model.layers:  # heavy dropout: the check must run in eval mode to see equal losses
        layer.self_attn.attention_dropout = 0.5
    loss_model = CausalLMLoss(model)
    precision = FLOAT32
    line = check_examples_kept_apart(loss_model, precision)
    assert "examples kept apart in LlamaForCausalLM's sdpa attention" in line and loss_model.training
    # a mask builder that does not read the positions: examples see each other, refused by name
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ConfigError, match="does not keep packed examples apart.*--batching_strategy padding"):
        check_examples_kept_apart(loss_model, precision)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_keeps_packed_examples_apart(family_dir, family):
    from leantune.models.attention import AUTO, resolve_attention

    path = family_dir(family)
    config = AutoModelForCausalLM.from_pretrained(path).config
    attention = resolve_attention(config, AUTO, "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    line = check_examples_kept_apart(CausalLMLoss(model), FLOAT32)
    assert "examples kept apart" in line
    assert FAMILY_SHAPE["max_position_embeddings"] >= 24


def test_the_plan_traces_the_mask_packing_apart_builds():
    from leantune.models.presets import model_config
    from leantune.planning.fake_step import trace_step

    def peaks(attention, *flags):
        config = model_config("tiny")
        config._attn_implementation = attention
        cfg = parse_run_config(["--model_name", "tiny", "--context_length", "256", "--batch_size_training", "2",
                                "--tiled_mlp", "off", *flags])
        fake = trace_step(cfg, config, torch.device("cpu"), "none")
        real = trace_step(cfg, config, torch.device("cpu"), "none", fake=False)
        assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown  # the plan is a real step
        return fake.peak_bytes

    apart, concatenated = peaks("sdpa"), peaks("sdpa", "--packed_examples", "concatenated")
    # SDPA turns the boolean mask into an additive one in every layer and keeps it for backward
    batch, seq = 2, 256
    assert apart - concatenated >= model_config("tiny").num_hidden_layers * batch * seq * seq * 4
    # varlen (auto's choice) builds no mask: apart costs only the rows' own position ids and RoPE tables
    # (cos and sin per row instead of one shared row) and, in each layer, the copy that joins its examples'
    # attention outputs (kept for backward without checkpointing): nothing of seq x seq
    tiny = model_config("tiny")
    extra = peaks("varlen") - peaks("varlen", "--packed_examples", "concatenated")
    assert 0 < extra <= batch * seq * (8 + 2 * tiny.head_dim * 4 + tiny.num_hidden_layers * tiny.hidden_size * 4)


def test_full_rows_batch_packs_two_examples_a_row_when_apart():
    batch = full_rows_batch(2, 8, vocab=50, apart=True)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] * 2
    assert "position_ids" not in full_rows_batch(2, 8, vocab=50, apart=False)


def test_a_run_says_what_fitting_the_context_cut(tiny_model_dir, tmp_path, write_jsonl, capsys):
    # prompts of about n + 2 tokens: two fill the context, one answer runs past it, six fit
    records = [{"prompt": "word " * n, "completion": "yes"} for n in (5, 10, 80, 90, 6, 7, 8, 9)]
    records.append({"prompt": "word " * 5, "completion": "word " * 80})
    data = write_jsonl(records)
    common = ["--model_name", str(tiny_model_dir), "--dataset", "custom_dataset", "--data_path", str(data),
              "--context_length", "64", "--max_train_step", "1", "--num_epochs", "1", "--val_fraction", "0",
              "--num_workers_dataloader", "0", "--save_model", "false"]
    assert finetuning.main([*common, "--output_dir", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert ("data: training split: 3 of 9 examples are longer than --context_length 64: 1 cut to fit, 2 left out "
            "(the prompt fills the context) (--overlong_examples drop leaves them out); ") in printed
    assert "packing: examples kept apart" in printed
    assert finetuning.main([*common, "--overlong_examples", "drop", "--output_dir", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert ("data: training split: 3 of 9 examples are longer than --context_length 64: left out "
            "(--overlong_examples truncate keeps their start); ") in printed
    with pytest.raises(ConfigError, match="packed_examples: applies to --batching_strategy packing"):
        parse_run_config(["--batching_strategy", "padding", "--packed_examples", "concatenated"])


def test_a_state_saved_before_packing_apart_resumes_only_as_it_packed(tmp_path):
    """A state from before --packed_examples packed concatenated: resuming it with the new default is refused."""
    from leantune.training.resume_checks import check_compatible

    def state_of(*flags):
        flat = parse_run_config(list(flags)).flat()
        del flat["packed_examples"]  # saved before the flag existed
        return {"config": flat, "progress": {"batches_seen": 2}}

    with pytest.raises(ConfigError, match="--packed_examples 'concatenated' -> 'apart'"):
        check_compatible(state_of(), parse_run_config([]).flat(), tmp_path)
    check_compatible(state_of(), parse_run_config(["--packed_examples", "concatenated"]).flat(), tmp_path)
    padded = ["--batching_strategy", "padding"]
    check_compatible(state_of(*padded), parse_run_config(padded).flat(), tmp_path)  # padding: nothing to tell apart


def test_validation_and_the_batch_check_pass_the_rows_position_ids(tiny_model_dir, tmp_path, monkeypatch):
    """Every forward of a packed-apart run's rows gets their position ids: training, validation, the batch check."""
    from leantune.planning import confirm

    calls = []
    original = CausalLMLoss.forward

    def recording(self, input_ids, labels, position_ids=None, segments=None, real_tokens=None, images=None):
        calls.append((torch.is_grad_enabled(), input_ids.shape[1], position_ids is not None))
        return original(self, input_ids, labels, position_ids, segments, real_tokens, images)

    monkeypatch.setattr(CausalLMLoss, "forward", recording)
    assert finetuning.main(["--model_name", str(tiny_model_dir), "--context_length", "64", "--max_train_step", "2",
                            "--num_epochs", "1", "--max_eval_step", "1", "--num_workers_dataloader", "0",
                            "--save_model", "false", "--output_dir", str(tmp_path)]) == 0
    rows = [(training, packed) for training, length, packed in calls if length == 64]  # training: with gradients
    assert (True, True) in rows and (False, True) in rows and all(packed for _, packed in rows)
    cfg = parse_run_config(["--context_length", "32"])
    calls.clear()
    confirm.confirm_step(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg.training, cfg.data, FLOAT32)(2)
    assert calls == [(True, 32, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_check_passes_under_half_precision_autocast(load_tiny, dtype):
    """The GPU defaults' autocast (bf16; fp16 with a GradScaler), on the CPU stand-in: apart is still bit-equal."""
    precision = Precision(torch.device("cpu"), torch.float32, dtype, dtype == torch.float16, str(dtype))
    assert "examples kept apart" in check_examples_kept_apart(CausalLMLoss(load_tiny()), precision)
