"""A 4-bit base read shard-first under FSDP2: each rank's bytes and scales are those of the whole weight's
quantization, a rank reads only the blocks that hold its bytes, the skeleton makes LoRA's weights as a whole
load does, and the filled shards are the whole load's, bit for bit. Two ranks against one process (losses,
adapter, resume): tests/test_distributed.py's qlora cases."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import one_rank_group
from leantune.flags import parse_run_config
from leantune.distributed.shard_first import join_padded, scale_counts, shard_rows
from leantune.models.quantized_slices import covering_elements, owned_blocks, quant_state, quantize_bytes

bnb = pytest.importorskip("bitsandbytes")
QLORA = ["--use_peft", "--quantization", "4bit", "--enable_fsdp", "--lora_dropout", "0"]


def _rank_parts(weight: torch.Tensor, world: int, blocksize: int) -> tuple[list, list]:
    flat, numel = weight.reshape(-1), weight.numel()
    rows = (numel + 1) // 2
    packed, scales = [], []
    for rank in range(world):
        start, stop = shard_rows(rows, rank, world)
        first, last = covering_elements(start, stop, numel, blocksize)
        part, owned = quantize_bytes(flat[first:last], element_start=first, byte_start=start, byte_stop=stop,
                                     numel=numel, blocksize=blocksize, quant_type="nf4")
        packed.append(part)
        scales.append(owned)
    return packed, scales


# rows of 64 (every shard whole blocks), rows of 576, shapes whose shards cut blocks and bytes, a weight smaller
# than the ranks
@pytest.mark.parametrize("shape", [(64, 64), (96, 576), (130, 70), (7, 9), (1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_ranks_bytes_and_scales_join_into_the_whole_weights_quantization(shape, dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    whole, whole_state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    for world in (1, 2, 3, 4, 5):
        packed, scales = _rank_parts(weight, world, 64)
        assert torch.equal(torch.cat(packed), whole), world
        state = quant_state(torch.cat(scales), shape, dtype, 64, "nf4", nested=True)
        for name in ("absmax", "offset"):
            assert torch.equal(getattr(state, name), getattr(whole_state, name)), (world, name)
        assert torch.equal(state.state2.absmax, whole_state.state2.absmax)
        assert torch.equal(state.state2.code, whole_state.state2.code)
        assert state.shape == whole_state.shape and state.dtype == whole_state.dtype


# shards that cut blocks: the ranks keep unequal counts of scales
@pytest.mark.parametrize("shape", [(130, 70), (100, 64), (7, 9)])
def test_the_scales_each_rank_sends_padded_join_into_the_whole_weights(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    _, whole = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type="nf4")
    rows, world = (weight.numel() + 1) // 2, 3
    _, scales = _rank_parts(weight, world, 64)
    counts = scale_counts(weight.numel(), rows, 64, world)
    assert counts == [part.numel() for part in scales] and len(set(counts)) > 1
    padded = [torch.cat([part, torch.full((max(counts) - part.numel(),), -1.0)]) for part in scales]
    assert torch.equal(join_padded(padded, counts), whole.absmax)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_a_rank_reads_only_the_blocks_that_hold_its_bytes(world):
    numel, blocksize = 8192 * 1024 + 96, 64  # shards cut blocks
    rows = numel // 2
    owned = 0
    for rank in range(world):
        start, stop = shard_rows(rows, rank, world)
        first, last = covering_elements(start, stop, numel, blocksize)
        assert first <= 2 * start and last >= min(2 * stop, numel)  # every element of its bytes
        assert last - first <= 2 * (stop - start) + 2 * blocksize  # and at most a block more on each side
        block_first, block_last = owned_blocks(start, stop, numel, blocksize)
        assert block_first == owned  # the ranks' blocks follow on: each block's scale kept by one rank
        owned = block_last
    assert owned == -(-numel // blocksize)


def _whole_and_skeleton(model_dir, argv: list[str]):
    """The model a whole 4-bit load makes (with LoRA) and the skeleton a shard-first load makes, each from the
    same seed; returns (whole, skeleton, cfg, precision)."""
    from leantune.builders.model import build_model
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(model_dir), *argv])
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu"))
    models = []
    for shard_first in (False, True):
        torch.manual_seed(cfg.training.seed)
        model, _ = build_model(cfg, precision, log=lambda _: None, shard_first=shard_first)
        models.append(model)
    return models[0], models[1], cfg, precision


def test_the_skeleton_makes_loras_weights_and_buffers_as_a_whole_load_and_holds_no_weight(tiny_model_dir):
    from leantune.models.loading import count_parameters
    from leantune.models.skeleton import is_stand_in

    whole, skeleton, _, _ = _whole_and_skeleton(tiny_model_dir, QLORA)
    real = {name: t for name, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.device.type != "meta"}
    lora = {name for name in real if ".lora_" in name}
    assert lora and lora == {name for name, _ in whole.named_parameters() if ".lora_" in name}
    wholes = dict([*whole.named_parameters(), *whole.named_buffers()])
    for name in lora | {name for name, _ in skeleton.named_buffers()}:
        assert torch.equal(real[name], wholes[name]), name
    stand_ins = [name for name, t in real.items() if is_stand_in(t)]
    assert len(stand_ins) == 14 and all(real[name].untyped_storage().nbytes() == 1 for name in stand_ins)
    assert set(real) == lora | set(stand_ins) | {name for name, _ in skeleton.named_buffers()}  # the rest on meta
    assert count_parameters(skeleton) == count_parameters(whole)  # the run's model line: a stand-in is 2 a byte


# float32 weights (the CPU's default), bfloat16 weights quantized from bfloat16 values (a GPU run's), and the
# other 4-bit format without the double quantization
@pytest.mark.parametrize("weights", [[], ["--pure_bf16"], ["--quant_type", "fp4", "--no_use_double_quant"]])
def test_a_shard_first_load_fills_the_shards_a_whole_load_makes(weights, tiny_model_dir):
    from leantune.builders.loss_and_optimizer import loss_model_for
    from leantune.distributed.context import DistContext
    from leantune.distributed.fsdp import shard_model
    from leantune.distributed.shard_first import ShardFirstLoad
    from leantune.models.checkpoint_slices import CheckpointSlices

    whole, skeleton, cfg, precision = _whole_and_skeleton(tiny_model_dir, [*QLORA, *weights])
    assert precision.weight_dtype == (torch.bfloat16 if "--pure_bf16" in weights else torch.float32)
    context, cpu = DistContext(rank=0, world_size=1, sharded=True), torch.device("cpu")
    with one_rank_group():
        whole_loss = shard_model(loss_model_for(whole, cfg.training, sharded=True), context, cpu, None, False)
        load = ShardFirstLoad(CheckpointSlices.find(tiny_model_dir)[0], precision.weight_dtype)
        skeleton_loss = loss_model_for(skeleton, cfg.training, sharded=True)
        load.keep(skeleton_loss)
        shard_model(skeleton_loss, context, cpu, None, False)
        load.fill(skeleton_loss, context, cpu)
        expected = dict([*whole_loss.named_parameters(), *whole_loss.named_buffers()])
        for name, tensor in [*skeleton_loss.named_parameters(), *skeleton_loss.named_buffers()]:
            assert tensor.dtype == expected[name].dtype and torch.equal(_local(tensor), _local(expected[name])), name
        pairs = [(a, b) for a, b in zip(whole_loss.modules(), skeleton_loss.modules()) if hasattr(a, "quant_state")]
        assert len(pairs) == 14
        for whole_layer, layer in pairs:
            ours, theirs = layer.quant_state.as_dict(packed=True), whole_layer.quant_state.as_dict(packed=True)
            assert ours.keys() == theirs.keys()
            assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == []
    assert load.checkpoint.bytes_read == load.whole_bytes > 0  # one rank reads all of it, once


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shard_first_or_why(model_dir, config, argv=QLORA, weight_dtype=torch.float32) -> tuple[bool, list[str]]:
    from leantune.builders.sharding import shard_first_checkpoint

    cfg, lines = parse_run_config(["--model_name", str(model_dir), *argv]), []
    chosen = shard_first_checkpoint(cfg.model, cfg.quant, cfg.distributed, config, weight_dtype, lines.append)
    return chosen is not None, lines


def test_a_checkpoint_that_cannot_be_read_in_slices_loads_whole_and_says_why(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert _shard_first_or_why(tiny_model_dir, config) == (True, [])
    assert _shard_first_or_why(tiny_model_dir, config, ["--use_peft", "--enable_fsdp"]) == (False, [])  # not 4-bit
    note = "note: each rank loads the whole 4-bit base in host memory, then keeps its shard: "
    pickled = tmp_path / "pickled"  # weights in a pickle, which loads whole
    pickled.mkdir()
    shutil.copy(tiny_model_dir / "config.json", pickled)
    torch.save(load_file(tiny_model_dir / "model.safetensors"), pickled / "pytorch_model.bin")
    assert _shard_first_or_why(pickled, config) == (False, [
        f"{note}{pickled} has no model.safetensors or model.safetensors.index.json (its weights are in "
        "pytorch_model.bin, which loads whole)"])
    changed = {"renamed": ("lm_head.weight", lambda t: t, "output.weight"),  # names transformers changes as it loads
               "packed": ("model.layers.0.self_attn.q_proj.weight",
                          lambda t: t.to(torch.uint8).reshape(-1, 1)[:64], None)}
    whys = {"renamed": "its checkpoint has no tensor named lm_head.weight",  # a pre-quantized or other checkpoint
            "packed": "its checkpoint's model.layers.0.self_attn.q_proj.weight is U8 [64, 1], not the model's [64, 64]"}
    for case, (key, change, new_key) in changed.items():
        folder = tmp_path / case
        shutil.copytree(tiny_model_dir, folder)
        tensors = load_file(folder / "model.safetensors")
        tensors[new_key or key] = change(tensors.pop(key))
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        chosen, lines = _shard_first_or_why(folder, config)
        assert not chosen and lines[0].startswith(f"{note}{whys[case]}"), lines


def test_models_whose_loading_changes_their_weights_load_whole(tiny_model_dir):
    from transformers import AutoConfig, GPT2Config

    quantized = AutoConfig.from_pretrained(tiny_model_dir)
    quantized.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert _shard_first_or_why(tiny_model_dir, quantized)[1][0].endswith(
        "its checkpoint is quantized already (its config has a quantization_config)")
    gpt2 = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128)  # Conv1D layers, stored transposed
    assert _shard_first_or_why(tiny_model_dir, gpt2)[1][0].endswith(
        "its layers are Conv1D, whose weights transformers transposes before quantizing them")


def test_a_checkpoints_rows_and_elements_are_read_as_stored(tiny_model_dir):
    from safetensors.torch import load_file

    from leantune.models.checkpoint_slices import CheckpointSlices

    stored = load_file(tiny_model_dir / "model.safetensors")
    checkpoint, why = CheckpointSlices.find(tiny_model_dir)
    assert why == "" and all(checkpoint.entry(key)["shape"] == list(stored[key].shape) for key in stored)
    assert checkpoint.entry("__metadata__") is None  # the header's metadata is no tensor
    try:
        for key in ("model.layers.1.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"):
            tensor = stored[key]
            rows = tensor.shape[0]
            for start, stop in ((0, rows), (1, rows // 2 + 1), (rows - 1, rows), (rows, rows)):
                assert torch.equal(checkpoint.rows(key, start, stop), tensor[start:stop]), (key, start, stop)
            flat = tensor.reshape(-1)
            for start, stop in ((0, flat.numel()), (3, 61), (flat.numel() - 5, flat.numel())):
                assert torch.equal(checkpoint.elements(key, start, stop), flat[start:stop]), (key, start, stop)
    finally:
        checkpoint.close()


STORED = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.randn(2, 4).bfloat16(), "c": torch.tensor(-7)}


def _rewritten_header(path, into, change):
    """``path`` with its header changed by ``change(header)``, its bytes as they were."""
    import json
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    change(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    into.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])
    return into


def test_a_tensor_and_its_rows_read_as_stored_and_what_lies_outside_is_refused(tmp_path):
    """Each dtype and a scalar read as stored; rows past a tensor's end (the next tensor's bytes), a dtype the
    reader does not know, and a header whose byte range is not its shape's are refused before a byte is read."""
    from safetensors.torch import save_file

    from leantune.models.safetensors_stream import read_header, read_rows, read_tensor

    path = tmp_path / "three.safetensors"
    save_file(STORED, path)
    header, start = read_header(path)
    with open(path, "rb") as file:
        for name, tensor in STORED.items():
            read = read_tensor(file, header[name], start)
            assert read.dtype == tensor.dtype and read.shape == tensor.shape and torch.equal(read, tensor), name
        assert torch.equal(read_rows(file, header["a"], start, 1, 3), STORED["a"][1:3])
        for name, rows in (("a", (2, 4)), ("a", (0, 4)), ("a", (-1, 2)), ("a", (2, 1)), ("c", (0, 2))):
            shape = list(STORED[name].shape)
            with pytest.raises(ValueError, match=rf"rows {rows[0]}:{rows[1]} are not within a tensor of shape "
                                                 rf"{re.escape(str(shape))}"):
                read_rows(file, header[name], start, *rows)
        with pytest.raises(ValueError, match="safetensors dtype F8_E4M3 is not supported here"):
            read_rows(file, {**header["a"], "dtype": "F8_E4M3"}, start, 0, 1)
    # b's shape claimed as 1 x 4: its range still holds 2 rows' bytes (16, not from byte 0)
    lying = _rewritten_header(path, tmp_path / "lying.safetensors", lambda h: h["b"].update(shape=[1, 4]))
    header, start = read_header(lying)
    with open(lying, "rb") as file:
        with pytest.raises(ValueError, match=r"a tensor's byte range \(16\) does not match its shape \[1, 4\]"):
            read_tensor(file, header["b"], start)


def test_the_header_lists_tensors_in_the_order_their_bytes_lie():
    from leantune.models.safetensors_stream import tensor_entries

    header = {"z": {"data_offsets": [0, 8]}, "__metadata__": {}, "a": {"data_offsets": [8, 8]},
              "m": {"data_offsets": [8, 16]}}
    assert [name for name, _ in tensor_entries(header)] == ["z", "a", "m"]


@pytest.mark.parametrize("name_length", range(8))  # every length of the header modulo 8
def test_a_streamed_file_starts_its_data_8_byte_aligned_and_loads_as_written(tmp_path, name_length):
    from safetensors.torch import load_file

    from leantune.models.safetensors_stream import read_header, write_streamed

    tensors = {"w" * (1 + name_length): torch.randn(3, 5), "bias": torch.arange(4, dtype=torch.int64)}
    path = tmp_path / "streamed.safetensors"
    layout = [(name, t.dtype, list(t.shape)) for name, t in tensors.items()]
    assert write_streamed(path, layout, tensors.__getitem__) == 3 * 5 * 4 + 4 * 8  # the data's bytes
    header, data_start = read_header(path)
    assert data_start % 8 == 0  # the format's alignment: 8 bytes of length, then a header padded to 8
    assert header["__metadata__"] == {"format": "pt"}  # what transformers looks for
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    write_streamed(path, layout, tensors.__getitem__, metadata={"format": "pt", "total": "1"})
    assert read_header(path)[0]["__metadata__"] == {"format": "pt", "total": "1"}
    for wrong in (torch.zeros(3, 5, dtype=torch.float64), torch.zeros(5, 3)):  # made unlike its layout: refused
        with pytest.raises(ValueError, match=r"made torch.float\d+ \[\d, \d\], laid out torch.float32 \[3, 5\]"):
            # the lambda runs within write_streamed, in this iteration: no late binding
            write_streamed(path, layout, lambda name: wrong if name.startswith("w") else tensors[name])  # noqa: B023


def test_a_weight_stored_transposed_or_modules_kept_in_float32_under_bf16_load_whole(tiny_model_dir, tmp_path):
    """A transposed weight has its element count but not its shape: read in slices it would quantize wrong, so the
    checkpoint is refused by its shape. A model that keeps modules in float32 loads whole for bf16 weights only."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from leantune.models.checkpoint_slices import CheckpointSlices, why_not_in_slices

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    checkpoint, _ = CheckpointSlices.find(tiny_model_dir)
    assert why_not_in_slices(checkpoint, model, torch.float32) == ""
    assert why_not_in_slices(checkpoint, model, torch.bfloat16) == ""
    model._keep_in_fp32_modules = ["lm_head"]
    assert why_not_in_slices(checkpoint, model, torch.float32) == ""  # float32 weights: nothing kept apart
    assert why_not_in_slices(checkpoint, model, torch.bfloat16) == (
        "it keeps some modules in float32 as it loads (transformers' _keep_in_fp32_modules)")
    model._keep_in_fp32_modules = None
    model._keep_in_fp32_modules_strict = ["lm_head"]
    assert why_not_in_slices(checkpoint, model, torch.bfloat16).endswith("(transformers' _keep_in_fp32_modules)")
    model._keep_in_fp32_modules_strict = None
    folder = tmp_path / "transposed"
    shutil.copytree(tiny_model_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.0.mlp.gate_proj.weight"  # 128 x 64, stored 64 x 128
    tensors[key] = tensors[key].T.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert why_not_in_slices(CheckpointSlices.find(folder)[0], model, torch.float32) == (
        f"its checkpoint's {key} is F32 [64, 128], not the model's [128, 64] in floating point")


def _open_files(folder) -> int:
    """This process's open descriptors of files in ``folder``."""
    import os

    opened = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened += os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        except OSError:  # closed meanwhile
            pass
    return opened


def test_a_sharded_checkpoint_reads_from_each_shard_through_one_open_file_each(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from leantune.models.checkpoint_slices import CheckpointSlices

    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    stored = {k: v for path in (tmp_path / "sharded").glob("*.safetensors") for k, v in load_file(path).items()}
    checkpoint, why = CheckpointSlices.find(tmp_path / "sharded")
    assert why == "" and checkpoint.entry("__metadata__") is None and checkpoint.entry("missing") is None
    before = _open_files(tmp_path / "sharded")
    key = "model.layers.1.mlp.down_proj.weight"  # 64 x 128
    for _ in range(3):
        assert torch.equal(checkpoint.rows(key, 2, 5), stored[key][2:5])
    assert _open_files(tmp_path / "sharded") == before + 1  # its file opened once, kept open
    flat = stored[key].reshape(-1)
    for start, stop in ((128 + 3, 256 - 5), (130, 131), (5 * 128, 6 * 128 + 1)):  # ranges starting past row 0
        assert torch.equal(checkpoint.elements(key, start, stop), flat[start:stop]), (start, stop)
    assert torch.equal(checkpoint.rows("lm_head.weight", 0, 2), stored["lm_head.weight"][:2])  # another shard
    checkpoint.close()
    assert _open_files(tmp_path / "sharded") == before
    assert torch.equal(checkpoint.rows(key, 0, 1), stored[key][:1])  # a closed checkpoint opens its files again
    checkpoint.close()
    assert checkpoint.bytes_read == (3 * 3 + 1 + 1 + 2 + 1) * 128 * 4 + 2 * 64 * 4  # the rows read, each time


def test_a_folder_without_weights_says_so_and_a_hub_id_fetches_its_index_and_files(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    from leantune.models.checkpoint_slices import CheckpointSlices, local_checkpoint_dir

    (tmp_path / "empty").mkdir()
    assert CheckpointSlices.find(tmp_path / "empty") == (
        None, f"{tmp_path / 'empty'} has no model.safetensors or model.safetensors.index.json")
    assert local_checkpoint_dir(str(tiny_model_dir)) == tiny_model_dir
    index = tmp_path / "index.json"
    index.write_text('{"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}')
    fetched = []

    def snapshot_download(source, allow_patterns):
        fetched.append((source, allow_patterns))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda source, name: str(index))
    assert local_checkpoint_dir("org/sharded") == tmp_path / "snapshot"

    def no_index(source, name):
        raise EntryNotFoundError("no index")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_index)
    local_checkpoint_dir("org/single")
    assert fetched == [("org/sharded", ["s1.safetensors", "s2.safetensors", "model.safetensors.index.json", "*.json"]),
                       ("org/single", ["model.safetensors", "model.safetensors.index.json", "*.json"])]


def test_an_empty_shard_quantizes_to_no_bytes_and_no_scales(monkeypatch):
    def kernel_launch(elements, **kwargs):  # a CUDA kernel launched on nothing: an error, not empty bytes
        raise RuntimeError("launched on an empty tensor")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", kernel_launch)
    packed, scales = quantize_bytes(torch.zeros(0), element_start=0, byte_start=5, byte_stop=5, numel=8, blocksize=64,
                                    quant_type="nf4")
    assert (packed.shape, packed.dtype, scales.shape, scales.dtype) == ((0, 1), torch.uint8, (0,), torch.float32)


@pytest.mark.parametrize("blocksize", [128, 256])
def test_other_block_sizes_join_into_the_whole_weights_quantization(blocksize):
    weight = torch.randn(40, 100, generator=torch.Generator().manual_seed(2))
    whole, state = bnb.functional.quantize_4bit(weight, blocksize=blocksize, compress_statistics=False,
                                                quant_type="fp4")
    numel, rows = weight.numel(), (weight.numel() + 1) // 2
    packed, scales = [], []
    for rank in range(3):
        start, stop = shard_rows(rows, rank, 3)
        first, last = covering_elements(start, stop, numel, blocksize)
        part, owned = quantize_bytes(weight.reshape(-1)[first:last], element_start=first, byte_start=start,
                                     byte_stop=stop, numel=numel, blocksize=blocksize, quant_type="fp4")
        packed.append(part)
        scales.append(owned)
    assert torch.equal(torch.cat(packed), whole) and torch.equal(torch.cat(scales), state.absmax)
