"""`leantune merge` (an adapter folded into its base, one tensor at a time) and `leantune generate`."""

from __future__ import annotations

import io
import json

import pytest
import torch

from leantune import finetuning
from leantune.flags import parse_run_config
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
    assert "torch_dtype" not in json.loads((tmp_path / "bf16" / "config.json").read_text())  # not in the base's
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
    args = generate.parser().parse_args(["--model_name", "x", "--max_new_tokens", "12", "--temperature", "1.5",
                                         "--do_sample", "--seed", "1"])
    assert generate.generate(model, tokenizer, "Name three colours.", args, out=io.StringIO()) == texts[
        "--do_sample --seed 1"]  # the seed decides the draw
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


class _ScriptedModel:
    """A model whose ``generate`` streams the tokens it is told to (special tokens among them) and records how it
    was called: what generate.py asks of transformers, without a model's randomness."""

    device = torch.device("cpu")

    def __init__(self, replies):
        self.replies, self.calls = list(replies), []

    def generate(self, input_ids, attention_mask, streamer, **kwargs):
        self.calls.append({"input_ids": input_ids[0].tolist(), **kwargs})
        new = torch.tensor([self.replies.pop(0)])
        streamer.put(input_ids)
        for token in new[0]:
            streamer.put(token[None])
        streamer.end()
        return torch.cat([input_ids, new], dim=1)


def _args(*flags):
    return generate.parser().parse_args(["--model_name", "m", *flags])


def test_the_generate_flags_parse_to_their_types_and_defaults(capsys):
    args = _args()
    assert (args.max_new_tokens, args.seed, args.do_sample, args.chat, args.prompt, args.dtype) == (
        128, 0, False, False, None, None)
    assert (args.temperature, args.top_p, args.top_k, args.repetition_penalty) == (None, None, None, None)
    args = _args("--temperature", "0.5", "--top_p", "0.9", "--top_k", "5", "--repetition_penalty", "1.5", "--seed",
                 "3", "--max_new_tokens", "7", "--dtype", "bfloat16")
    parsed = (args.temperature, args.top_p, args.top_k, args.repetition_penalty, args.seed, args.max_new_tokens)
    assert parsed == (0.5, 0.9, 5, 1.5, 3, 7) and [type(v) for v in parsed] == [float, float, int, float, int, int]
    for wrong in ([], ["--model_name", "m", "--dtype", "int8"]):  # --model_name is required; --dtype has choices
        with pytest.raises(SystemExit):
            generate.parser().parse_args(wrong)
        assert capsys.readouterr().err.startswith("usage: leantune generate")


def test_a_reply_streams_without_its_prompt_or_special_tokens_and_passes_only_the_options_given(tokenizer):
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    model = _ScriptedModel([[40, bos, 50, 60, eos], [70, 80]])
    out = io.StringIO()
    reply = generate.generate(model, tokenizer, "Name three colours.", _args("--max_new_tokens", "5", "--top_k", "4",
                                                                             "--temperature", "0.7"), out)
    assert reply == tokenizer.decode([40, 50, 60]) and out.getvalue() == reply + "\n"
    call = model.calls[0]
    assert call["input_ids"] == tokenizer("Name three colours.")["input_ids"]
    assert {k: v for k, v in call.items() if k != "input_ids"} == {
        "max_new_tokens": 5, "do_sample": False, "pad_token_id": tokenizer.pad_token_id, "temperature": 0.7,
        "top_k": 4}
    tokenizer_without_pad = type("NoPad", (), {"__getattr__": lambda self, name: getattr(tokenizer, name),
                                               "__call__": lambda self, *a, **k: tokenizer(*a, **k),
                                               "pad_token_id": None})()
    generate.generate(model, tokenizer_without_pad, "x", _args("--top_p", "0.5", "--repetition_penalty", "1.2"),
                      io.StringIO())
    assert model.calls[1]["pad_token_id"] == eos and model.calls[1]["top_p"] == 0.5
    assert model.calls[1]["repetition_penalty"] == 1.2 and "temperature" not in model.calls[1]


def test_a_chat_keeps_the_conversation_until_an_empty_line(tokenizer, monkeypatch):
    model = _ScriptedModel([[40, 50], [60, 70], [80]])
    monkeypatch.setattr(generate, "load", lambda *args, **kwargs: (model, tokenizer))
    out = io.StringIO()
    generate.run(_args("--chat", "--max_new_tokens", "2"), lines=iter(["Hi\n", "And then?\n", "\n", "never read\n"]),
                 out=out)
    first, second = tokenizer.decode([40, 50]), tokenizer.decode([60, 70])
    assert out.getvalue() == f"{first}\n{second}\n" and len(model.calls) == 2
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "And then?"}]
    for call, messages in zip(model.calls, (turns[:1], turns)):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert call["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    generate.run(_args("--max_new_tokens", "1", "--prompt", "Go"), lines=iter(["unused\n"]), out=io.StringIO())
    assert model.calls[2]["input_ids"] == tokenizer("Go")["input_ids"]  # no --chat: the prompt as it is


def test_generate_takes_bfloat16_on_a_gpu_that_has_it_and_the_dtype_asked_for(monkeypatch, capsys):
    loaded = []

    def load(model_name, base_model, dtype, device, images=False):
        loaded.append((dtype, device.type))
        raise OSError("")  # stop there: one line naming the error, whatever its text

    monkeypatch.setattr(generate, "load", load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this test decides what the machine has
    assert generate.main(["--model_name", "m", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == "leantune: error: OSError"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    generate.main(["--model_name", "m", "--prompt", "x"])
    generate.main(["--model_name", "m", "--prompt", "x", "--dtype", "float16"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    generate.main(["--model_name", "m", "--prompt", "x"])
    assert loaded == [(torch.float32, "cpu"), (torch.bfloat16, "cuda"), (torch.float16, "cuda"),
                      (torch.float32, "cuda")]
    monkeypatch.setattr(generate, "run", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert generate.main(["--model_name", "m", "--chat"]) == 0  # leaving the --chat loop


def test_chat_asks_for_a_chat_template_and_a_model_loads_in_the_dtype_asked_for(tiny_model_dir, tmp_path, capsys):
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert generate.main(["--model_name", str(folder), "--chat", "--prompt", "Hi"]) == 2
    assert capsys.readouterr().err.strip() == (f"leantune: error: --chat: {folder}'s tokenizer has no chat template; "
                                               "drop --chat to continue the prompt as text")
    model, _ = generate.load(str(tiny_model_dir), None, torch.bfloat16, torch.device("cpu"))
    assert model.dtype == torch.bfloat16 and not model.training
    run_dir = _adapter(tiny_model_dir, tmp_path / "run")
    model, _ = generate.load(str(run_dir), None, torch.bfloat16, torch.device("cpu"))
    assert model.dtype == torch.bfloat16 and type(model).__name__ == "PeftModel" and not model.training


def _copy(source, folder):
    import shutil

    shutil.copytree(source, folder)
    return folder


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        data.pop(key)
    path.write_text(json.dumps(data))


def test_a_merge_keeps_the_bases_companions_the_runs_tokenizer_and_the_umask(tiny_model_dir, tmp_path):
    """Into a new folder under missing parents: the merged folder appears whole (staged beside it under a hidden
    name), readable as the umask allows; the config keeps the base's dtype, the generation config is the base's,
    the tokenizer the run's; one file without an index gets none."""
    import os

    run_dir = _adapter(tiny_model_dir, tmp_path / "run")
    _edit_json(run_dir / "tokenizer_config.json", model_max_length=77)  # the run's own tokenizer
    out, told, staged = tmp_path / "a" / "b" / "merged", [], []
    mask = os.umask(0o022)
    try:
        def log(line):
            told.append(line)
            staged.append(sorted(p.name for p in out.parent.iterdir()))

        assert merge_run(run_dir, out, log=log) == out
        assert os.umask(0o022) == 0o022  # left as it was
    finally:
        os.umask(mask)
    (while_merging,) = {tuple(names) for names in staged[:-1]}  # the shard written, the folder not there yet
    assert len(while_merging) == 1 and while_merging[0].startswith(".merged.merging-") and staged[-1] == ["merged"]
    assert told[0] == "merged model.safetensors: 21 tensors" and "4-bit" not in " ".join(told)
    assert (out.stat().st_mode & 0o7777) == 0o755 and sorted(p.name for p in out.parent.iterdir()) == ["merged"]
    assert json.loads((out / "config.json").read_text())["dtype"] == json.loads(
        (tiny_model_dir / "config.json").read_text())["dtype"]
    assert "torch_dtype" not in json.loads((out / "config.json").read_text())
    assert (out / "generation_config.json").read_text() == (tiny_model_dir / "generation_config.json").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 77
    assert not (out / "model.safetensors.index.json").exists()
    for name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):  # a run saved no tokenizer:
        (run_dir / name).unlink()                                                    # the base's
    (tmp_path / "empty-existing").mkdir()
    merge_run(run_dir, tmp_path / "empty-existing", log=lambda _: None)  # an empty folder is taken
    base_length = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["model_max_length"]
    assert json.loads((tmp_path / "empty-existing" / "tokenizer_config.json").read_text())["model_max_length"] == (
        base_length) != 77


def test_a_single_shard_with_an_index_keeps_it_and_older_configs_get_torch_dtype(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    base = _copy(tiny_model_dir, tmp_path / "base")
    tensors = load_file(base / "model.safetensors")
    (base / "model.safetensors").unlink()
    save_file(tensors, base / "model-00001-of-00001.safetensors", metadata={"format": "pt", "made_by": "a test"})
    (base / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 1, "note": "kept"},
        "weight_map": {name: "model-00001-of-00001.safetensors" for name in tensors}}))
    _edit_json(base / "config.json", torch_dtype="float32")
    (base / "generation_config.json").unlink()  # a base without one: none copied
    run_dir = _adapter(base, tmp_path / "run")
    merge_run(run_dir, tmp_path / "out", dtype="bfloat16", log=lambda _: None)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["note"] == "kept" and index["metadata"]["total_size"] != 1
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert not (tmp_path / "out" / "generation_config.json").exists()
    from leantune.models.safetensors_stream import read_header

    metadata = read_header(tmp_path / "out" / "model-00001-of-00001.safetensors")[0]["__metadata__"]
    assert metadata == {"format": "pt", "made_by": "a test"}  # each shard's own metadata kept


def _refused(run_dir, out, base=None) -> str:
    with pytest.raises(MergeRefused) as caught:
        merge_run(run_dir, out, base=base, log=lambda _: None)
    return str(caught.value)


def test_merge_refuses_adapters_it_cannot_fold_each_by_name(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    run_dir = _adapter(tiny_model_dir, tmp_path / "run")
    out = tmp_path / "out"
    config = json.loads((run_dir / "adapter_config.json").read_text())
    for key, value, what in (("peft_type", "IA3", None), ("use_dora", True, "DoRA"),
                             ("rank_pattern", {"q_proj": 4}, "per-module ranks"),
                             ("alpha_pattern", {"q_proj": 4}, "per-module alphas"),
                             ("modules_to_save", ["lm_head"], "modules_to_save")):
        (run_dir / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        expected = ("the adapter is IA3, not LoRA" if what is None else
                    f"the adapter uses {what} ({key}), which leantune merge does not fold")
        assert _refused(run_dir, out).startswith(expected)
    (run_dir / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    assert _refused(run_dir, out) == (f"{run_dir / 'adapter_config.json'} names no base model; give it with "
                                      "--model_name")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ("runs/out/missing", "runs/missing", "a/b/c", "~/base", "org/model"):  # paths, then a hub name
        (run_dir / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": name}))
        assert _refused(run_dir, out).startswith(f"base model {name!r}: " + (
            "no such directory" if name != "org/model" else "not a directory, and the hub could not give it"))
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda name, **kwargs: asked.append((name, kwargs)) or str(tiny_model_dir))
    merge_run(run_dir, tmp_path / "from-hub", log=lambda _: None)  # what a hub base fetches: its weights and JSON
    assert asked == [("org/model", {"allow_patterns": ["*.safetensors", "*.json"]})]
    (run_dir / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(run_dir / "adapter_model.safetensors")
    save_file({**tensors, "base_model.model.lm_head.weight": torch.zeros(4, 4)}, run_dir / "adapter_model.safetensors")
    assert _refused(run_dir, out).endswith("holds base_model.model.lm_head.weight, which is not a LoRA A or B matrix "
                                           "(trained embeddings or modules_to_save): merge it with peft's "
                                           "merge_and_unload")
    save_file(tensors, run_dir / "adapter_model.safetensors")
    (run_dir / "leantune_adapter.json").write_text(json.dumps({"model_type": "gemma"}))
    assert _refused(run_dir, out) == (f"the adapter was trained on a gemma model, {tiny_model_dir} is a llama; give "
                                      "its base with --model_name")
    for facts, quant_type in (({"quant_type": "fp4"}, "fp4"), ({}, "nf4")):
        (run_dir / "leantune_adapter.json").write_text(json.dumps({"model_type": "llama", "quantization": "4bit",
                                                                     **facts}))
        told = []
        merge_run(run_dir, tmp_path / quant_type, log=told.append)
        assert (f"the adapter was trained on a 4-bit ({quant_type}) base: merged onto the unquantized weights of "
                f"{tiny_model_dir}") in told
    (run_dir / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "peft_type"}))
    merge_run(run_dir, tmp_path / "no-type", log=lambda _: None)  # peft's type unsaid: LoRA
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert _refused(empty, tmp_path / "x").endswith("give the --output_dir of a LoRA run")
    (empty / "adapter_config.json").write_text("{}")  # a config without weights
    assert _refused(empty, tmp_path / "x").startswith(f"{empty} has no adapter_model.safetensors")


def test_merge_refuses_bases_it_cannot_merge_onto_each_by_name(tiny_model_dir, block_aligned_model_dir, tmp_path,
                                                                capsys):
    from safetensors.torch import load_file, save_file

    run_dir = _adapter(tiny_model_dir, tmp_path / "run", target_modules=["v_proj"])
    assert _refused(run_dir, tmp_path / "o", str(block_aligned_model_dir)).startswith(
        "the adapter's model.layers.0.self_attn.v_proj.weight is 32 x 64, ")  # rows x columns, as stored
    key = "model.layers.0.self_attn.v_proj.weight"
    cases = {"pickled": None, "renamed": lambda t: {k.replace(key, "other"): v for k, v in t.items()},
             "quantized": lambda t: {**t, key: t[key].to(torch.uint8)},
             "float8": lambda t: {**t, "model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)}}
    for case, change in cases.items():
        base = _copy(tiny_model_dir, tmp_path / case)
        tensors = load_file(base / "model.safetensors")
        (base / "model.safetensors").unlink()
        if change is None:
            torch.save(tensors, base / "pytorch_model.bin")
        else:
            save_file(change(tensors), base / "model.safetensors")
        why = _refused(run_dir, tmp_path / "o", str(base))
        assert why == {
            "pickled": f"{base} has no model.safetensors (nor model.safetensors.index.json); leantune merge reads "
                       "safetensors only: save the base with save_pretrained(..., safe_serialization=True)",
            "renamed": f"the adapter changes {key}, which {base} does not have: it was trained on another model; give "
                       "its base with --model_name",
            "quantized": f"{base}'s {key} is stored as U8 (a quantized base): merge onto the unquantized base, given "
                         "with --model_name",
            "float8": f"{base} stores F8_E4M3 tensors, which leantune merge does not read; merge onto a bfloat16, "
                      "float16 or float32 base"}[case]
    quantized = _copy(tiny_model_dir, tmp_path / "prequantized")
    _edit_json(quantized / "config.json", quantization_config={"quant_method": "bitsandbytes"})
    assert _refused(run_dir, tmp_path / "o", str(quantized)).startswith(f"{quantized} is a quantized checkpoint")
    with pytest.raises(SystemExit):
        merge.main([str(run_dir), str(tmp_path / "o"), "--dtype", "int8"])
    assert "usage: leantune merge" in capsys.readouterr().err  # not one of --dtype's choices


def test_a_merge_that_fails_midway_leaves_nothing_behind(tiny_model_dir, tmp_path, monkeypatch):
    import leantune.use.merge as merge_module

    def failing(base_dir, staging, *args):
        (staging / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(merge_module, "merge_shards", failing)
    with pytest.raises(OSError, match="disk full"):
        merge_run(_adapter(tiny_model_dir, tmp_path / "run"), tmp_path / "out", log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    real_rmtree = merge_module.shutil.rmtree

    def stubborn(path, ignore_errors=False):  # a file the filesystem will not let go of (NFS's .nfs files)
        real_rmtree(path, ignore_errors=True)
        if not ignore_errors:
            raise OSError("Device or resource busy")

    monkeypatch.setattr(merge_module.shutil, "rmtree", stubborn)
    with pytest.raises(OSError, match="disk full"):  # the user's error, not the clean-up's
        merge_run(tmp_path / "run", tmp_path / "out", log=lambda _: None)


class _Flushes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self):
        self.flushes += 1


def test_a_chat_read_from_standard_input_prints_to_standard_output_as_it_streams(tokenizer, monkeypatch):
    model = _ScriptedModel([[40, 50, 60]])
    monkeypatch.setattr(generate, "load", lambda *args, **kwargs: (model, tokenizer))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n\n"))
    shown = _Flushes()
    monkeypatch.setattr("sys.stdout", shown)
    assert generate.main(["--model_name", "m", "--chat", "--max_new_tokens", "3"]) == 0
    assert shown.getvalue() == tokenizer.decode([40, 50, 60]) + "\n" and shown.flushes >= 1  # each piece at once


def test_a_missing_path_is_named_and_a_hub_name_goes_to_the_hub(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("./model", "a/b/c", "~/model"):
        assert generate.main(["--model_name", name, "--prompt", "x"]) == 2
        assert capsys.readouterr().err.strip() == (f"leantune: error: --model_name {name}: no such directory (a model "
                                                   "directory, a LoRA run's output_dir or a hub name)")
    assert generate.main(["--model_name", "org/model", "--prompt", "x"]) == 2  # offline here: the hub's own error
    assert "no such directory" not in capsys.readouterr().err
