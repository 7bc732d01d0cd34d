"""`leantune merge` (an adapter folded into its base, one tensor at a time) and `leantune generate`."""

from __future__ import annotations

import io
import json

import pytest
import torch

from leantune import finetuning
from leantune.cli_args import parse_run_config
from leantune.models.merging import MergeRefused
from leantune.use import generate, merge
from leantune.use.merge import merge_run

IDS = torch.tensor([[1, 5, 9, 42, 7, 300, 12, 77]])


def _load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _adapter(base_dir, run_dir, seed=0, **lora):
    """A LoRA adapter as peft saves it, with B drawn (it starts at zero), and the base's tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    lora = {"target_modules": ["q_proj", "v_proj"], **lora}
    model = get_peft_model(_load(base_dir), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, **lora))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    model.save_pretrained(run_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(run_dir)
    return run_dir


def _peft_merged(base_dir, run_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(_load(base_dir), str(run_dir)).merge_and_unload().eval()


def _assert_same_model(merged_dir, reference):
    merged = _load(merged_dir)
    assert merged.state_dict().keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, reference(IDS).logits, rtol=1e-6, atol=1e-6)


def test_a_merged_adapter_equals_peft_merge_and_unload_shard_by_shard(tiny_model_dir, tmp_path):
    """The base saved in several shards: the merged model keeps them (and the index) and equals peft's merge."""
    sharded_base = tmp_path / "base"
    from transformers import AutoTokenizer

    _load(tiny_model_dir).save_pretrained(sharded_base, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(sharded_base)
    shards = sorted(p.name for p in sharded_base.glob("*.safetensors"))
    assert len(shards) > 2
    run_dir = _adapter(sharded_base, tmp_path / "run")
    told: list[str] = []
    merge_run(run_dir, tmp_path / "merged", base=str(sharded_base), log=told.append)
    assert sorted(p.name for p in (tmp_path / "merged").glob("*.safetensors")) == shards
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    base_index = json.loads((sharded_base / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == base_index["metadata"]["total_size"]  # the tensors' bytes
    assert index["weight_map"] == base_index["weight_map"]
    assert (tmp_path / "merged" / "tokenizer.json").is_file() and (tmp_path / "merged" / "config.json").is_file()
    assert any(line.startswith("merged 4 LoRA pairs") for line in told)
    _assert_same_model(tmp_path / "merged", _peft_merged(sharded_base, run_dir))
    merge_run(run_dir, tmp_path / "bf16", base=str(sharded_base), dtype="bfloat16", log=told.append)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    merged = _load(tmp_path / "bf16", dtype="auto")
    assert merged.dtype == torch.bfloat16  # the config says what the shards hold
    # summed in float32, then rounded once: peft's float32 merge cast to bfloat16, bit for bit
    reference = _peft_merged(sharded_base, run_dir).state_dict()
    for name, value in merged.state_dict().items():
        assert torch.equal(value, reference[name].to(torch.bfloat16)), name
    bf16_index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert bf16_index["metadata"]["total_size"] == base_index["metadata"]["total_size"] // 2  # its own bytes


def test_rslora_and_a_conv1d_base_merge_as_peft_merges_them(tiny_model_dir, tmp_path):
    """rsLoRA scales by alpha / sqrt(r); GPT-2's Conv1D stores its weights transposed (peft's fan_in_fan_out)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    run_dir = _adapter(tiny_model_dir, tmp_path / "rslora", use_rslora=True)
    merge_run(run_dir, tmp_path / "rslora-merged", log=lambda _: None)
    _assert_same_model(tmp_path / "rslora-merged", _peft_merged(tiny_model_dir, run_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=4, n_positions=64, vocab_size=len(tokenizer)))
    gpt2.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    # c_attn is 64 x 192 as stored, c_proj square: merged untransposed it would be silently wrong
    run_dir = _adapter(tmp_path / "gpt2", tmp_path / "conv1d", target_modules=["c_attn", "c_proj"],
                       fan_in_fan_out=True)
    merge_run(run_dir, tmp_path / "conv1d-merged", log=lambda _: None)
    _assert_same_model(tmp_path / "conv1d-merged", _peft_merged(tmp_path / "gpt2", run_dir))


def test_a_qlora_trained_adapter_merges_onto_the_unquantized_base_and_says_so(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    run_dir, lines = tmp_path / "run", []
    finetuning.run(parse_run_config([
        "--model_name", str(tiny_model_dir), "--use_peft", "--quantization", "4bit", "--context_length", "64",
        "--max_train_step", "2", "--num_epochs", "1", "--run_validation", "false", "--num_workers_dataloader", "0",
        "--lr", "1e-2", "--enable_memory_monitoring", "--output_dir", str(run_dir)]), log=lines.append)
    # the run's last line says how to try what it saved
    assert lines[-1] == (f"try it: leantune generate --model_name {run_dir} --chat --prompt \"Name three colours.\"; "
                         f"fold the adapter into its base: leantune merge {run_dir} {run_dir}-merged")
    assert json.loads((run_dir / "leantune_adapter.json").read_text())["quantization"] == "4bit"
    told: list[str] = []
    assert merge.main([str(run_dir), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merge_run(run_dir, tmp_path / "again", dtype="float32", log=told.append)
    assert any(f"trained on a 4-bit (nf4) base: merged onto the unquantized weights of {tiny_model_dir}" in line
               for line in told)
    reference = _peft_merged(tiny_model_dir, run_dir)
    base = _load(tiny_model_dir)
    assert any(not torch.equal(value, base.state_dict()[name]) for name, value in reference.state_dict().items())
    _assert_same_model(tmp_path / "merged", reference)


def test_merge_refuses_in_one_line_what_it_cannot_merge(tiny_model_dir, block_aligned_model_dir, tmp_path, capsys):
    run_dir = _adapter(tiny_model_dir, tmp_path / "run")
    assert merge.main([str(run_dir), str(tmp_path / "out"), "--model_name", str(block_aligned_model_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "leantune: error: the adapter's model.layers.0.self_attn.q_proj.weight is " \
                                     "64 x 64" in err and "give its base with --model_name" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.merging-*"))  # nothing half-written
    with pytest.raises(MergeRefused, match="no such directory"):
        merge_run(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(MergeRefused, match="a whole model .* nothing to merge"):
        merge_run(tiny_model_dir, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(MergeRefused, match="exists and is not empty"):
        merge_run(run_dir, tmp_path / "taken")
    config = json.loads((run_dir / "adapter_config.json").read_text())
    (run_dir / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(MergeRefused, match="DoRA"):
        merge_run(run_dir, tmp_path / "out")


def test_generate_prints_text_from_a_model_a_run_and_a_chat(tiny_model_dir, tmp_path, capsys):
    assert generate.main(["--model_name", str(tiny_model_dir), "--prompt", "Name three colours.",
                          "--max_new_tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()
    run_dir = _adapter(tiny_model_dir, tmp_path / "run")
    assert generate.main(["--model_name", str(run_dir), "--chat", "--prompt", "Hi", "--max_new_tokens", "6",
                          "--do_sample", "--temperature", "0.7"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_errors_are_one_line(tmp_path, capsys):
    assert generate.main(["--model_name", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"leantune: error: --model_name {tmp_path / 'missing'}: no such directory (a model directory, " \
                  "a LoRA run's output_dir or a hub name)"
    assert generate.main(["--model_name", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "leantune: error: give --prompt TEXT (not empty), or --chat to type turns"


def test_generate_says_a_missing_relative_path_or_a_mismatched_base_in_one_line(tiny_model_dir, block_aligned_model_dir,
                                                                                 tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()  # "out/quickstart" from the wrong folder: a path, not a hub id to retry
    assert generate.main(["--model_name", "out/quickstart", "--prompt", "x"]) == 2
    assert "out/quickstart: no such directory" in capsys.readouterr().err
    run_dir = _adapter(tiny_model_dir, tmp_path / "run")
    assert generate.main(["--model_name", str(run_dir), "--base_model", str(block_aligned_model_dir), "--prompt",
                          "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leantune: error: ") and "\n" not in err


def _prompts_seen(model, monkeypatch) -> list[list[int]]:
    """The token ids each ``model.generate`` call is given, recorded as it runs."""
    seen, original = [], model.generate

    def recording(**kwargs):
        seen.append(kwargs["input_ids"][0].tolist())
        return original(**kwargs)

    monkeypatch.setattr(model, "generate", recording)
    return seen


def test_do_sample_samples_by_its_seed_and_greedy_does_not(tiny_model_dir, monkeypatch):
    model, tokenizer = generate.load(str(tiny_model_dir), None, torch.float32, torch.device("cpu"))
    texts = {}
    for flags in (["--do_sample", "--seed", "1"], ["--do_sample", "--seed", "2"], ["--seed", "1"], ["--seed", "2"]):
        args = generate.parser().parse_args(["--model_name", "x", "--max_new_tokens", "12", "--temperature", "1.5",
                                             *flags])
        texts[" ".join(flags)] = generate.generate(model, tokenizer, "Name three colours.", args, out=io.StringIO())
    assert texts["--do_sample --seed 1"] != texts["--do_sample --seed 2"]  # a random model's tokens, drawn twice
    assert texts["--seed 1"] == texts["--seed 2"] != texts["--do_sample --seed 1"]


def test_a_chat_prompt_holds_the_templates_bos_once(tiny_model_dir, tmp_path, monkeypatch):
    """A tokenizer that adds BOS to what it encodes (as Llama 3's does) must not add it before a chat template's own."""
    import shutil

    from tokenizers import processors

    folder = tmp_path / "bos-adding"
    shutil.copytree(tiny_model_dir, folder)
    model, tokenizer = generate.load(str(folder), None, torch.float32, torch.device("cpu"))
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    assert tokenizer("Hi")["input_ids"][0] == bos
    seen = _prompts_seen(model, monkeypatch)
    for flags in (["--chat"], []):
        args = generate.parser().parse_args(["--model_name", "x", "--max_new_tokens", "2", *flags])
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False) if flags else "Hi"
        generate.generate(model, tokenizer, text, args, out=io.StringIO())
    assert [ids.count(bos) for ids in seen] == [1, 1] and all(ids[0] == bos for ids in seen)
