"""Deliberate breakages the suite must catch: each is applied alone to a scratch copy of this checkout, the
tests that claim the feature run there, and the table says which breakages they caught and which they missed.

    python tests/breakages.py                 # every breakage (about 10 minutes on 2 cores)
    python tests/breakages.py --only tolerance,fp4
    python tests/breakages.py --list

Not run by CI (each breakage is a pytest run of its own). Before resolving an issue, add a breakage of each
feature it built (a dropped flag, a skipped layer, a constant) and run the script on them: a breakage the
tests miss is a test to write. A breakage whose text is no longer in its file is reported ``stale``: the
code moved, so the breakage must be written again against it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Breakage:
    name: str
    why: str  # what the breakage does to a user
    file: str  # relative to the checkout
    old: str  # found exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: the files (and -k selections) that claim the feature


B = Breakage
BREAKAGES = [
    # issue 38's nine
    B("tolerance", "the own-loss check lets a 1% logit scale through", "src/leantune/builders/own_loss.py",
      "TOLERANCE = 1e-4", "TOLERANCE = 5e-2", ("tests/test_model_checks.py", "-k", "beyond_leantunes_path")),
    B("chat_rewrite", "a template that rewrites earlier turns is labelled from its prefixes", "src/leantune/formats/chat.py",
      "if not (through.startswith(before) and whole.startswith(through)):", "if False:", ("tests/test_chat_data.py",)),
    B("fp4", "--quant_type fp4 trains as NF4", "src/leantune/models/quantized.py",
      "bnb_4bit_quant_type=quant.quant_type", 'bnb_4bit_quant_type="nf4"', ("tests/test_qlora.py", "-k", "planner_traces")),
    B("double_quant_plan", "the planner always double-quantizes", "src/leantune/models/quantized.py",
      "compress_statistics=weight.compress_statistics", "compress_statistics=True",
      ("tests/test_qlora.py", "-k", "planner_traces")),
    B("norm_reset", "the norm of steps in backward accumulates across steps", "src/leantune/training/in_backward.py",
      '        """Before the step\'s backward: the norm gathers afresh."""\n        self._squares = None',
      '        """Before the step\'s backward: the norm gathers afresh."""',
      ("tests/test_lean_optimizers.py", "-k", "weights_of_stepping")),
    B("compile_last_layer", "--compile leaves the last decoder layer eager", "src/leantune/models/compiling.py",
      "    for layer in layers:\n        layer.compile(", "    for layer in layers[:-1]:\n        layer.compile(",
      ("tests/test_compile.py", "-k", "keep_their_names")),
    B("recomputed_bias", "selective_ops' recomputed Linear drops its bias", "src/leantune/checkpointing/recomputed_linear.py",
      "return out if self.bias is None else out + self.bias.to(out.dtype)", "return out",
      ("tests/test_selective_ops.py", "-k", "recomputed_op")),
    B("split_1mib", "the allocator model splits a large block leaving exactly 1 MiB", "src/leantune/memory/allocator_model.py",
      "else (left > SMALL_REQUEST_BYTES)", "else (left >= SMALL_REQUEST_BYTES)", ("tests/test_allocator_model.py",)),
    B("bnb_weight_decay", "8-bit AdamW decays by bitsandbytes' 0.01 whatever --weight_decay says",
      "src/leantune/optimizers/bitsandbytes_8bit.py", "cls(params, lr=lr, weight_decay=weight_decay,", "cls(params, lr=lr,",
      ("tests/test_lean_optimizers.py", "-k", "weight_decay")),
    # issue 36: long context
    B("host_memory", "--return_host_memory says it maps large allocations and does not", "src/leantune/memory/host_allocator.py",
      "return mallopt(M_MMAP_THRESHOLD, threshold) == 1", "return True", ("tests/test_memory.py", "-k", "return_host")),
    B("tiles_skip_layer", "the tiled MLP leaves the last layer whole", "src/leantune/models/tiled_mlp.py",
      "    count = 0\n    for layer in decoder_layers(model):", "    count = 0\n    for layer in decoder_layers(model)[:-1]:",
      ("tests/test_long_context.py",)),
    # issue 37: the GPU paths
    B("bnb_sync", "8-bit AdamW stepped in backward waits for the GPU once per weight", "src/leantune/training/in_backward.py",
      "    module.sync_gpu = _no_sync", "    module.sync_gpu = original",
      ("tests/test_lean_optimizers.py", "-k", "never_wait")),
    B("paged_sync", "paged 8-bit AdamW stepped in backward waits for the GPU once per weight",
      "src/leantune/training/in_backward.py",
      "        with without_bitsandbytes_sync(), on_the_default_stream(param.device):",
      '        with (__import__("contextlib").nullcontext() if self.optimizer.is_paged else without_bitsandbytes_sync()), '
      'on_the_default_stream(param.device):',
      ("tests/test_lean_optimizers.py", "-k", "never_wait")),
    B("stream_check", "under FSDP2 (hooks on its reduce-scatter stream) 8-bit AdamW stepped in backward waits for "
      "the GPU once per weight again", "src/leantune/training/in_backward.py",
      "    if original is None:\n        yield\n        return\n    module.sync_gpu = _no_sync",
      "    if original is None or torch.cuda.current_stream() != torch.cuda.default_stream():\n        yield\n"
      "        return\n    module.sync_gpu = _no_sync", ("tests/test_lean_optimizers.py", "-k", "never_wait")),
    # issue 41: the optimizer registry and torchao's 4-bit AdamW
    B("four_bit_codec", "a 4-bit state is saved as torchao's subclass, readable only where torchao is imported first",
      "src/leantune/optimizers/torchao_4bit.py", "    if type(value).__name__ != SUBCLASS:\n        return value",
      "    return value", ("tests/test_adamw_4bit.py", "-k", "weights_only or subclass")),
    B("four_bit_scale", "the planner's 4-bit stand-in keeps a scale per 256 elements, not 128",
      "src/leantune/optimizers/torchao_4bit.py", 'torch.zeros(param.numel() // BLOCK, device=param.device)',
      'torch.zeros(param.numel() // 256, device=param.device)', ("tests/test_adamw_4bit.py", "-k", "stand_in")),
    B("four_bit_rungs", "--optimizer auto never takes the 4-bit rungs", "src/leantune/optimizers/torchao_4bit.py",
      '    rungs=(Rung("4-bit AdamW", "adamw_4bit", False, True, 5),', '    rungs=() and (Rung("4-bit", "x", 0, 0, 0),',
      ("tests/test_adamw_4bit.py", "-k", "rungs")),
    B("four_bit_decay", "4-bit AdamW decays by torchao's default 0.01 whatever --weight_decay says",
      "src/leantune/optimizers/torchao_4bit.py", "optim.AdamW4bit(groups, lr=lr, weight_decay=weight_decay,",
      "optim.AdamW4bit(groups, lr=lr,", ("tests/test_lean_optimizers.py", "-k", "weight_decay_asked")),
    B("offload_own_state", "a CPU-offloaded run's training state is saved through torch's by-name mapping, "
      "which cannot map the host copies it steps", "src/leantune/optimizers/torchao_cpu_offload.py",
      "    own_state=True,", "    own_state=False,", ("tests/test_cpu_offload_optimizer.py", "-k", "resume")),
    B("offload_clipping", "--gradient_clipping with the CPU-offloaded AdamW is accepted and silently does nothing",
      "src/leantune/optimizers/torchao_cpu_offload.py", 'conflicts=(("gradient_clipping",', 'conflicts=(("seed",',
      ("tests/test_cpu_offload_optimizer.py", "-k", "cannot_work_with")),
    B("offload_grad_norm", "the gradient norm reads the host copies, which on a GPU may still be in flight",
      "src/leantune/training/step.py", "params = [p for p in self.loss_model.parameters() if p.requires_grad]",
      'params = [p for group in self.optimizer.param_groups for p in group["params"]]',
      ("tests/test_cpu_offload_optimizer.py", "-k", "gradient_norm")),
    B("offload_plan", "the planner keeps AdamW's state on the GPU for offloaded weights",
      "src/leantune/optimizers/torchao_cpu_offload.py", "if param.numel() >= MIN_OFFLOADED_SIZE:", "if False:",
      ("tests/test_cpu_offload_optimizer.py", "-k", "plan")),
    B("offload_switch", "--optimizer_cpu_offload is accepted and the run steps plain AdamW on the GPU",
      "src/leantune/cli_args.py", "            training.optimizer = entry.name", "            pass",
      ("tests/test_cpu_offload_optimizer.py", "-k", "switch")),
    B("format_bundled", "--dataset chat_dataset without --data_path feeds Alpaca records to the chat encoder",
      "src/leantune/data/__init__.py", "    if not cfg.data_path and entry.from_bundled is not None:",
      "    if False:", ("tests/test_chat_data.py",)),
    B("format_cache_key", "a changed --assistant_turns reads the examples tokenized with the old one",
      "src/leantune/data/__init__.py", '"options": {flag: getattr(cfg, flag) for flag in entry.options},', "",
      ("tests/test_data_sources.py", "tests/test_chat_data.py")),
    B("format_cache_template", "a changed --chat_template file's text reads the examples tokenized with the old one",
      "src/leantune/data/__init__.py", '"format": entry.cache_settings(cfg), ', "",
      ("tests/test_data_sources.py", "tests/test_chat_data.py")),
    B("format_options", "--assistant_turns last with an Alpaca dataset is accepted and does nothing",
      "src/leantune/config/data.py", "getattr(self, flag) == defaults[flag] or self.dataset in owners",
      "True", ("tests/test_data.py", "tests/test_chat_data.py", "tests/test_bad_input.py")),
    B("format_fields", "--column_map accepts a field the format never reads",
      "src/leantune/config/data.py", "unknown = [f for f in named if reads is not None and f not in reads]",
      "unknown = []", ("tests/test_data.py", "tests/test_data_sources.py", "tests/test_bad_input.py")),
    B("mode_register", "a policy class defined without its mode registered: the flag never offers it",
      "src/leantune/checkpointing/policies.py", "            MODES[cls.name] = cls", "            pass",
      ("tests/test_checkpointing_modes.py", "-k", "registers")),
    B("offload_rebind", "a resumed CPU-offloaded run stops decaying the learning rate of the weights stepped on the "
      "GPU", "src/leantune/optimizers/torchao_cpu_offload.py", "    loading=_rebinding_groups,\n", "",
      ("tests/test_cpu_offload_optimizer.py", "-k", "schedule")),
    B("offload_skip_queue", "a skipped step's gradient copies stay queued for the next step",
      "src/leantune/optimizers/torchao_cpu_offload.py", "        optimizer.queue.clear()\n", "",
      ("tests/test_cpu_offload_optimizer.py", "-k", "skipped")),
    B("offload_fp16_weights", "float16 weights (a loss scaler) are accepted with the CPU-offloaded AdamW",
      "src/leantune/config/__init__.py", 'if why and model_dtype == "float16" and not tc.use_fp16:', "if False:",
      ("tests/test_cpu_offload_optimizer.py", "-k", "cannot_work_with")),
    B("offload_advice_conflicts", "the OOM advice offers --optimizer_cpu_offload to a run with --gradient_clipping",
      "src/leantune/memory/oom.py", "               and not optimizer_conflicts(entry, tc, cfg.model.model_dtype)\n", "",
      ("tests/test_cpu_offload_optimizer.py", "-k", "advice")),
    B("offload_host_check", "--optimizer auto takes the host-offloaded rung whatever host memory is left",
      "src/leantune/planning/optimizer_choice.py", "and least.host_bytes <= host_memory_available()", "",
      ("tests/test_cpu_offload_optimizer.py", "-k", "host_lacks")),
    B("planned_flag", "the planner builds the library optimizer itself on fake tensors instead of its stand-in",
      "src/leantune/planning/fake_step.py", "device_type=target.type, planned=fake, sharded=sharded)",
      "device_type=target.type, sharded=sharded)",
      ("tests/test_lean_optimizers.py", "tests/test_cpu_offload_optimizer.py", "-k", "plan")),
    B("four_bit_advice", "a 4-bit run out of memory is advised 8-bit moments, which are heavier",
      "src/leantune/optimizers/bitsandbytes_8bit.py", "current.state_bytes > 2", "current.state_bytes > 0",
      ("tests/test_adamw_4bit.py", "-k", "advice_names_it")),
    B("subclass_bytes", "the memory breakdown counts a 4-bit moment as the dense float32 tensor",
      "src/leantune/memory/tracker.py", "if is_traceable_wrapper_subclass(tensor) and not isinstance(tensor, DTensor):",
      "if False:", ("tests/test_adamw_4bit.py", "-k", "breakdown")),
    B("noise", "every run prints torchao's missing CUDA extensions and torch's enum deprecation",
      "src/leantune/__init__.py", "\ndrop_known_noise()", "\n", ("tests/test_first_hour.py", "-k", "prints_nothing")),
    B("four_bit_rounding", "bfloat16 weights under 4-bit AdamW are rounded to nearest (small updates lost)",
      "src/leantune/optimizers/torchao_4bit.py", "bf16_stochastic_round=True)", "bf16_stochastic_round=False)",
      ("tests/test_adamw_4bit.py",)),
    B("compile_layout", "a layer checkpointed around its __call__ is compiled without its checkpoint",
      "src/leantune/models/compiling.py", "and type(layer).__call__ is not torch.nn.Module.__call__", "and False",
      ("tests/test_compile.py", "-k", "around_its_call")),
    B("matmul_overloads", "a compiled graph's aten.mm.out is recomputed by selective_ops",
      "src/leantune/checkpointing/selective.py", 'return getattr(op, "overloadpacket", op)', "return op",
      ("tests/test_selective_ops.py", "-k", "every_overload")),
    B("assumed_context", "the batch check's budget uses the assumed CUDA context", "src/leantune/memory/step_peak.py",
      "return self.reserved_bytes + context_bytes(self.device)", "return self.reserved_bytes + 512 * 2**20",
      ("tests/test_step_peak.py",)),
    B("loading_peak", "the sharding line's peak is read after the monitor reset it", "src/leantune/finetuning.py",
      "              peak_before=loaded_peak, checkpoint=checkpoint)", "              checkpoint=checkpoint)",
      ("tests/test_fsdp_flags.py", "-k", "peak")),
    B("host_memory_unwired", "a CPU run never applies --return_host_memory", "src/leantune/finetuning.py",
      "                 return_host_memory(cfg.memory.return_host_memory, device.type, cfg.data.context_length)):",
      "                 None):", ("tests/test_memory.py", "-k", "applies_return_host_memory")),
    B("compile_check_unwired", "compiling never asks where a layer's checkpoint is", "src/leantune/models/compiling.py",
      "    check_checkpoint_inside(layers)\n", "", ("tests/test_compile.py", "-k", "around_its_call")),
    B("attention_overloads", "selective_ops recomputes SDPA's output reached through another overload",
      "src/leantune/checkpointing/selective.py", "return _packet(op) in _ATTENTION", "return op in _ATTENTION",
      ("tests/test_selective_ops.py", "-k", "attention_kernel")),
    B("varlen_capability", "the varlen flash kernel is used on a T4", "src/leantune/models/varlen_attention.py",
      "and cuda_capability(query.device) >= AMPERE", "",
      ("tests/test_long_context.py", "-k", "below_ampere")),
    B("offload_freed_inplace", "offload misses a saved tensor changed in place and freed",
      "src/leantune/checkpointing/offload.py", "self.counter, self.version = version_counter(tensor), tensor._version",
      "self.counter, self.version = torch.empty(0), 0", ("tests/test_offload.py", "-k", "in_place")),
    B("flash_capability", "FlashAttention 2 is allowed on a T4", "src/leantune/models/attention.py",
      "(capability := cuda_capability()) < AMPERE", "(capability := cuda_capability()) < (7, 0)",
      ("tests/test_model_checks.py", "-k", "below_ampere")),
    # issue 39: resuming never runs code
    B("rng_unpickled", "a resume unpickles rng_state.pth with code execution", "src/leantune/training/state.py",
      'rng = load_checkpoint_file(path / "rng_state.pth", numpy_arrays=True)["ranks"]',
      'rng = torch.load(path / "rng_state.pth", map_location="cpu", weights_only=False)["ranks"]',
      ("tests/test_checkpoint_files.py", "-k", "hostile")),
    # issue 40: a new user's first hour
    B("loud_bitsandbytes", "a plain LoRA run prints bitsandbytes' hub-kernel warning", "src/leantune/models/loading.py",
      "    if bitsandbytes_installed():  # peft imports it", "    if False:  # peft imports it",
      ("tests/test_first_hour.py", "-k", "third_party")),
    B("hub_retries", "a model name not here goes to transformers' retries", "src/leantune/models/loading.py",
      "    check_hub_id(name, flag)\n", "", ("tests/test_first_hour.py", "-k", "not_here or cached")),
    B("help_defaults", "--help says (default: None) and repeats the positive flag's text", "src/leantune/cli_args.py",
      "formatter_class=_HelpFormatter,", "", ("tests/test_first_hour.py", "-k", "help")),
    # issue 42: the lean levers under FSDP2
    B("packed_gathered_cast", "the per-rank plan gathers a 4-bit base's packed bytes as bf16",
      "src/leantune/planning/per_rank.py", "if self.gather and p.is_floating_point()", "if self.gather",
      ("tests/test_planning.py", "-k", "4bit_base")),
    B("quant_state_split", "the per-rank plan splits the quantization state every rank holds whole",
      "src/leantune/planning/per_rank.py",
      '    shares["parameter"] += shapes.replicated_bytes - (0 if cpu_offload else _split(shapes.replicated_bytes, '
      'world_size))\n', "", ("tests/test_planning.py", "-k", "4bit_base")),
    B("int8_sharded", "an 8-bit base is let through to FSDP2", "src/leantune/config/quantization.py",
      '    if quant.quantization == "8bit":\n        raise', '    if False:\n        raise',
      ("tests/test_bad_input.py", "-k", "8-bit")),
    B("rank_budgets_apart", "under FSDP each rank chooses by the budget it read itself",
      "src/leantune/planning/choose.py",
      "        budget = traces.least(budget, device)\n", "        pass\n", ("tests/test_distributed.py", "-k", "one_choice")),
    B("auto_by_whole_plan", "auto under FSDP compares one process's plan with the budget",
      "src/leantune/planning/plan.py",
      "    share = traces.share if traces is not None and traces.share is not None else (lambda plan: plan)",
      "    share = lambda plan: plan", ("tests/test_planning.py", "-k", "auto_under_fsdp or one_ranks_plan")),
    B("shapes_draw_rng", "planning the shards draws from the run's generator (another LoRA initialisation)",
      "src/leantune/planning/per_rank.py", "    with torch.random.fork_rng(devices=[]):\n        model = meta_model(",
      "    if True:\n        model = meta_model(", ("tests/test_planning.py", "-k", "draws_nothing")),
    B("anyprecision_dtensor", "anyprecision steps FSDP2's DTensors whole, not their local shards",
      "src/leantune/optimizers/anyprecision.py",
      "    return tensor.to_local() if isinstance(tensor, DTensor) else tensor", "    return tensor",
      ("tests/test_distributed.py", "-k", "anyprecision")),
    B("in_backward_local_norm", "under FSDP the step in backward reports one rank's share of the gradient norm",
      "src/leantune/training/in_backward.py", "            torch.distributed.all_reduce(squares)\n",
      "            pass\n", ("tests/test_distributed.py", "-k", "full-ft-in-backward")),
    B("in_backward_as_optimizer", "the plan files backward's moments under the optimizer's stage when it steps in backward",
      "src/leantune/planning/fake_step.py", "    if torch._C._current_graph_task_id() == -1:", "    if True:",
      ("tests/test_planning.py", "-k", "traced_as_backward")),
    # issue 42: 8-bit AdamW sharded
    B("sharded_8bit_float32", "under FSDP every weight keeps float32 moments: 8-bit AdamW saves nothing sharded",
      "src/leantune/optimizers/bitsandbytes_sharded.py",
      "return len(shape) == 2 and shape.numel() >= MIN_8BIT_SIZE and shape[1] % BLOCK == 0", "return False",
      ("tests/test_distributed.py", "-k", "adamw_8bit_as_one_process")),
    B("sharded_8bit_plan", "the planner counts one process's 8-bit layout for a sharded run",
      "src/leantune/optimizers/bitsandbytes_8bit.py",
      "if param.numel() < MIN_8BIT_SIZE or (self.sharded and not eight_bit_when_sharded(param.shape)):",
      "if param.numel() < MIN_8BIT_SIZE:", ("tests/test_sharded_8bit.py",)),
    B("sharded_8bit_scales_local", "each rank keeps its 8-bit scales as a plain tensor: a resume gives every rank rank 0's",
      "src/leantune/optimizers/bitsandbytes_sharded.py",
      'state["absmax1"], state["absmax2"] = _block_scales(param), _block_scales(param)',
      'state["absmax1"], state["absmax2"] = _block_scales(param).to_local(), _block_scales(param).to_local()',
      ("tests/test_distributed.py", "-k", "adamw-8bit")),
    B("sharded_8bit_resume_switch", "a resume switches --enable_fsdp with 8-bit AdamW and loads the other layout",
      "src/leantune/training/resume_checks.py",
      '    _check_state_layout(saved_value(saved, "enable_fsdp", defaults), now, path)\n', "",
      ("tests/test_sharded_8bit.py", "-k", "resume")),
    B("per_rank_loss_layers", "the per-rank plan counts two decoder layers gathered in the loss, where FSDP2 resharded them",
      "src/leantune/planning/per_rank.py", '    elif stage == "loss":', '    elif False:',
      ("tests/test_distributed.py", "-k", "per_rank_plan_holds")),
    B("sharded_8bit_plan_flag", "the planner traces one process's 8-bit layout for an FSDP run (the flag not passed)",
      "src/leantune/planning/fake_step.py", "planned=fake, sharded=sharded)", "planned=fake)",
      ("tests/test_sharded_8bit.py", "-k", "plan_of_a_sharded_run")),
    # issue 43: merge and generate
    B("merge_scale", "leantune merge scales the LoRA product by alpha, not alpha / r", "src/leantune/models/merging.py",
      "scale = alpha / rank ** 0.5 if config.get(\"use_rslora\") else alpha / rank",
      "scale = alpha / rank ** 0.5 if config.get(\"use_rslora\") else alpha", ("tests/test_merge_generate.py",)),
    B("merge_qlora_silent", "merging a QLoRA adapter does not say it goes onto the unquantized base",
      "src/leantune/use/merge.py", '    if facts.get("quantization") == "4bit":', "    if False:",
      ("tests/test_merge_generate.py", "-k", "qlora")),
    B("merge_shape_check", "an adapter of another model's shapes reaches the merge", "src/leantune/use/merge.py",
      "    check_pairs_fit(lora, base_dir, shards, str(base_dir))\n", "", ("tests/test_merge_generate.py", "-k", "refuses")),
    B("merge_dtype_config", "a merge with --dtype leaves the config's dtype as the base's", "src/leantune/use/merge.py",
      '        config["dtype"] = dtype\n', "", ("tests/test_merge_generate.py", "-k", "shard_by_shard")),
    B("try_line_dropped", "a run no longer ends by saying how to try what it saved", "src/leantune/training/loop.py",
      "            self.log(self.outputs.try_line)", "            pass", ("tests/test_merge_generate.py", "-k", "qlora")),
    # issue 42: a 4-bit base read shard-first
    B("shard_first_owned_blocks", "a block whose first value lies in a rank's bytes counts for the rank before it too",
      "src/leantune/models/quantized_slices.py", "    return (min(-(-2 * byte_start // blocksize), blocks),",
      "    return (min(2 * byte_start // blocksize, blocks),", ("tests/test_shard_first.py",)),
    B("shard_first_no_double_quant", "the shard-first quantization state drops the double quantization",
      "src/leantune/models/quantized_slices.py", "    if not nested:\n        return", "    if True:\n        return",
      ("tests/test_shard_first.py", "-k", "fills")),
    B("shard_first_lora_on_meta", "the skeleton's 4-bit stand-ins on meta: peft moves LoRA's new weights there",
      "src/leantune/models/skeleton.py", "    data = torch.empty(1, dtype=torch.uint8).expand(packed_rows, 1)",
      "    data = torch.empty(packed_rows, 1, dtype=torch.uint8, device=\"meta\")", ("tests/test_shard_first.py",)),
    B("shard_first_scales_not_joined", "each rank keeps only its own blocks' scales as the whole weight's",
      "src/leantune/distributed/shard_first.py", "    if context.world_size == 1:\n        return scales",
      "    if True:\n        return scales", ("tests/test_distributed.py", "-k", "qlora-full")),
    B("shard_first_float32_values", "a bfloat16 run's base quantized from float32 values, not the bfloat16 ones a whole "
      "load quantizes", "src/leantune/distributed/shard_first.py",
      "self.checkpoint.elements(key, first, last).to(self.weight_dtype)",
      "self.checkpoint.elements(key, first, last).float()", ("tests/test_shard_first.py", "-k", "fills")),
    B("shard_first_buffers", "the RoPE buffers left as to_empty made them", "src/leantune/distributed/shard_first.py",
      "            buffer.copy_(self.kept.pop(name))", "            pass", ("tests/test_shard_first.py", "-k", "fills")),
    B("shard_first_row_offset", "every rank reads the first rows of each tensor", "src/leantune/models/safetensors_stream.py",
      "    file.seek(data_start + entry[\"data_offsets\"][0] + start * row_bytes)",
      "    file.seek(data_start + entry[\"data_offsets\"][0])", ("tests/test_shard_first.py",)),
    B("shard_first_silent_fallback", "a checkpoint that cannot be read in slices loads whole without a word",
      "src/leantune/builders/sharding.py", "    if why:\n        log(", "    if why:\n        print(",
      ("tests/test_shard_first.py", "-k", "says_why")),
    B("shard_first_scales_untrimmed", "the ranks' padded scales joined with their padding",
      "src/leantune/distributed/shard_first.py",
      "    return torch.cat([part[:count] for part, count in zip(parts, counts)])", "    return torch.cat(parts)",
      ("tests/test_shard_first.py", "-k", "padded")),
    B("shard_first_format_fixed", "every shard-first 4-bit weight taken for NF4 with double quantization",
      "src/leantune/distributed/shard_first.py", "weight.quant_type, weight.compress_statistics)", "\"nf4\", True)",
      ("tests/test_shard_first.py", "-k", "fills")),
    B("shard_first_never_taken", "a 4-bit base under FSDP loaded whole on every rank again",
      "src/leantune/builders/sharding.py", "        return None\n    return checkpoint\n",
      "        return None\n    return None\n", ("tests/test_distributed.py", "-k", "qlora-full")),
    B("shard_first_conv1d", "a GPT-2 base read shard-first: its Conv1D weights quantized untransposed",
      "src/leantune/models/checkpoint_slices.py", "    if any(type(module).__name__ == \"Conv1D\"",
      "    if False and any(type(module).__name__ == \"Conv1D\"", ("tests/test_shard_first.py", "-k", "changes_their")),
    B("sharded_8bit_load_plain_dict", "a loaded 8-bit state cannot step a weight it had no state for",
      "src/leantune/optimizers/bitsandbytes_sharded.py", "    state: defaultdict = defaultdict(dict)",
      "    state: dict = {}", ("tests/test_sharded_8bit.py", "-k", "no_state_for")),
    # issue 51: an independent audit's mutations of the code added since c986472
    B("rows_unbounded", "reading rows past a tensor's end returns the next tensor's bytes",
      "src/leantune/models/safetensors_stream.py", "    if not 0 <= start <= stop <= (shape[0] if shape else 1):",
      "    if not stop <= (shape[0] if shape else 1):", ("tests/test_shard_first.py", "-k", "outside")),
    B("byte_range_unchecked", "a header whose byte range is not its shape's is read anyway",
      "src/leantune/models/safetensors_stream.py",
      "    if dtype is not None and torch.Size(entry[\"shape\"]).numel() * dtype.itemsize != end - begin:",
      "    if False:", ("tests/test_shard_first.py", "-k", "outside")),
    B("header_padding", "written files break the format's 8-byte alignment", "src/leantune/models/safetensors_stream.py",
      "encoded += b\" \" * (-len(encoded) % 8)", "encoded += b\" \" * (len(encoded) % 8)",
      ("tests/test_shard_first.py", "-k", "aligned")),
    B("slices_shape_unchecked", "a transposed weight of the same element count is quantized wrong, silently",
      "src/leantune/models/checkpoint_slices.py",
      "        if entry[\"dtype\"] not in FLOATS or list(entry[\"shape\"]) != list(param.shape):",
      "        if entry[\"dtype\"] not in FLOATS:", ("tests/test_shard_first.py", "-k", "transposed")),
    B("slices_fp32_modules_inverted", "bf16 runs slice modules that must load whole", "src/leantune/models/checkpoint_slices.py",
      "    if weight_dtype != torch.float32 and (", "    if weight_dtype == torch.float32 and (",
      ("tests/test_shard_first.py", "-k", "transposed")),
    B("merge_rslora_key", "rsLoRA adapters merge with plain LoRA's scale", "src/leantune/models/merging.py",
      "if config.get(\"use_rslora\") else", "if config.get(\"rslora\") else", ("tests/test_merge_generate.py", "-k", "rslora")),
    B("merge_untransposed", "Conv1D (GPT-2) adapters merge untransposed", "src/leantune/models/merging.py",
      "    delta = (delta.T if lora.fan_in_fan_out else delta) * lora.scale", "    delta = delta * lora.scale",
      ("tests/test_merge_generate.py", "-k", "rslora")),
    B("merge_rounds_twice", "a bf16 merge rounds the weight and the product before summing them",
      "src/leantune/models/merging.py", "    return (tensor.float() + delta).to(out)",
      "    return tensor.to(out) + delta.to(out)", ("tests/test_merge_generate.py", "-k", "shard_by_shard")),
    B("merge_index_size", "a bf16 merge's index states the base's size", "src/leantune/use/merge.py",
      "{\"metadata\": {**metadata, \"total_size\": total}", "{\"metadata\": {\"total_size\": total, **metadata}",
      ("tests/test_merge_generate.py", "-k", "shard_by_shard")),
    B("generate_greedy_always", "--do_sample does nothing", "src/leantune/use/generate.py",
      "do_sample=args.do_sample,", "do_sample=False,", ("tests/test_merge_generate.py", "-k", "do_sample")),
    B("generate_double_bos", "two BOS tokens before a chat prompt", "src/leantune/use/generate.py",
      "add_special_tokens=not args.chat", "add_special_tokens=True", ("tests/test_merge_generate.py", "-k", "bos")),
    B("varlen_window_off_by_one", "a sliding window of W over W + 1 tokens is not refused",
      "src/leantune/models/varlen_attention.py", "    if window is not None and window < segments.longest:",
      "    if window is not None and window + 1 < segments.longest:",
      ("tests/test_long_context.py", "-k", "binding_sliding")),
    B("sharded_8bit_codes_cast", "a resumed 8-bit state's scales and code books become bf16 (read as float32 by the "
      "kernel)", "src/leantune/optimizers/bitsandbytes_sharded.py",
      "_placed(value, param, name in self.non_castable_tensor_keys, move_to_device)",
      "_placed(value, param, False, move_to_device)", ("tests/test_sharded_8bit.py", "-k", "own_dtypes")),
    B("offload_state_stale", "after a resume the memory tracker counts a stale, empty state",
      "src/leantune/optimizers/torchao_cpu_offload.py",
      "        optimizer.d_param_groups = optimizer.d_opt.param_groups\n        optimizer.state = optimizer.d_opt.state\n",
      "        optimizer.d_param_groups = optimizer.d_opt.param_groups\n",
      ("tests/test_cpu_offload_optimizer.py", "-k", "loads_weights_only")),
    B("max_context_flops_tie", "of two levers reaching the same context, the slower wins",
      "src/leantune/planning/max_context.py", "-flops_per_token(r.plan) if r.plan else 0",
      "flops_per_token(r.plan) if r.plan else 0", ("tests/test_long_context.py", "-k", "longest_context_wins")),
    B("max_context_below_limit", "--max_context never returns the model's own position limit",
      "src/leantune/planning/max_context.py", "default=top + step)", "default=top)",
      ("tests/test_long_context.py", "-k", "own_position_limit")),
    B("rng_rank_zero", "every rank resumes rank 0's random state", "src/leantune/training/state.py",
      "restore_rng(rng[parts.dist.rank], parts.device)", "restore_rng(rng[0], parts.device)",
      ("tests/test_training_state.py", "-k", "own_random")),
    # issue 52: mixtures of experts
    B("llama4_decoder", "Llama 4's causal LM is refused again (transformers' get_decoder() is the whole model)",
      "src/leantune/models/structure.py", "    if decoder is base and isinstance(inner, torch.nn.Module)",
      "    if False and decoder is base and isinstance(inner, torch.nn.Module)",
      ("tests/test_moe.py", "-k", "llama4")),
    B("router_unmasked", "the router's loss counts padding tokens", "src/leantune/training/step.py",
      "balance = load_balancing_loss(output.router_logits, self.router_loss, real_tokens)",
      "balance = load_balancing_loss(output.router_logits, self.router_loss)",
      ("tests/test_moe.py", "-k", "routers_loss")),
    B("router_unweighted", "the router's term is added once per batch, not per target token",
      "src/leantune/training/step.py", "        router_sum = balance * targets_tensor(labels)\n", "        router_sum = balance\n",
      ("tests/test_moe.py", "-k", "routers_loss")),
    B("router_top_k", "the load-balancing loss counts every token's first expert only", "src/leantune/models/moe.py",
      "picked = torch.topk(probs, loss.top_k, dim=-1).indices", "picked = torch.topk(probs, 1, dim=-1).indices",
      ("tests/test_moe.py", "-k", "routers_loss or by_hand")),
    B("router_check_blind", "the self-check's stand-in returns no router logits, so a missing router term passes",
      "src/leantune/builders/own_loss.py", "                router_logits = tuple(hidden.reshape(-1, WIDTH) @ layer for layer in self.routers)",
      "                router_logits = None", ("tests/test_moe.py", "-k", "llama4 or real_shaped")),
    B("router_on_dense", "--output_router_logits is taken silently by a dense model", "src/leantune/models/facts.py",
      "        if expert_count(text_config(config)) is None:", "        if False:",
      ("tests/test_moe.py", "-k", "dense")),
    B("gpt_oss_packs", "gpt-oss packs examples that see each other", "src/leantune/models/attention.py",
      '    "gpt_oss": ("it builds', '    "gpt_oss_": ("it builds', ("tests/test_moe.py", "-k", "pads")),
    B("all_linear_no_experts", "all-linear on a mixture of experts leaves the experts out", "src/leantune/models/moe.py",
      "    wanted = [*linear_names, *experts] if all_linear else list(names)",
      "    wanted = list(linear_names) if all_linear else list(names)",
      ("tests/test_moe.py", "-k", "stay_unless or names_what")),
    B("router_lora_always", "the routers get LoRA without --lora_router", "src/leantune/models/moe.py",
      "    if router:\n        modules += router_modules", "    if True:\n        modules += router_modules",
      ("tests/test_moe.py", "-k", "stay_unless or names_what")),
    B("expert_dropout_unchecked", "dropout with expert targets reaches peft's raw ValueError",
      "src/leantune/models/loading.py", "    if targets.parameters and cfg.lora_dropout:",
      "    if False:", ("tests/test_moe.py", "-k", "bad_expert")),
    B("split_lora_unscaled", "the experts' low-rank path runs without its alpha / r scale", "src/leantune/models/experts.py",
      "        out = out + scale * grouped_mm(grouped_mm(x, p, offsets), q, offsets)",
      "        out = out + grouped_mm(grouped_mm(x, p, offsets), q, offsets)",
      ("tests/test_moe.py", "-k", "apart_equals or merged")),
    B("split_lora_dropped", "leantune's experts forward ignores the adapter", "src/leantune/models/experts.py",
      "    experts.leantune_lora = factors\n", "    experts.leantune_lora = {}\n",
      ("tests/test_moe.py", "-k", "apart_equals or merged")),
    B("frozen_expert_grad", "a frozen expert tensor's gradient is computed (a layer's experts again in memory)",
      "src/leantune/models/experts.py", "    if ctx.needs_input_grad[1]:\n        grad_weight",
      "    if True:\n        grad_weight", ("tests/test_moe.py", "-k", "no_merged")),
    B("split_factors_untransposed", "a transposed family's (gpt-oss, Llama 4) factors are read the other way round",
      "src/leantune/models/experts.py", "    p, q = (lhs, rhs) if transposed else",
      "    p, q = (lhs, rhs) if not transposed else", ("tests/test_moe.py", "-k", "apart_equals")),
    B("split_when_not_ours", "an experts forward that is not leantune's gets the wrapper anyway and drops LoRA",
      "src/leantune/models/experts.py", "    if not _runs_split(experts):", "    if False:",
      ("tests/test_moe.py", "-k", "apart_equals")),
    B("router_last_batch", "an accumulated step logs its last batch's router loss", "src/leantune/training/step.py",
      "                router_total += self.loss_model.router_loss_sum",
      "                router_total = 0 * router_total + self.loss_model.router_loss_sum",
      ("tests/test_moe.py", "-k", "accumulated")),
    B("router_validation_unmasked", "validation's router loss counts padding", "src/leantune/training/loop.py",
      "inputs = model_inputs(batch, self.device, routed(self.step.loss_model))",
      "inputs = model_inputs(batch, self.device, False)", ("tests/test_moe.py", "-k", "accumulated")),
    B("perplexity_with_router", "validation perplexity includes the router's term", "src/leantune/training/loop.py",
      '"val_perplexity": lines.perplexity(val_loss - router_sum / max(targets, 1))',
      '"val_perplexity": lines.perplexity(val_loss)', ("tests/test_moe.py", "-k", "accumulated")),
    B("experts_not_quantized", "--quantization 4bit leaves the experts in 16 bits", "src/leantune/models/quantized_experts.py",
      "    packed, state = import_bitsandbytes().functional.quantize_4bit(tensor, **_settings(quant))\n",
      "    return torch.nn.Parameter(tensor, requires_grad=False)\n", ("tests/test_moe.py", "-k", "4bit_experts_equal")),
    B("llama4_every_token", "Llama 4's experts run over every token again (transformers' own block)",
      "src/leantune/models/experts.py", '        elif type(module).__name__ == "Llama4TextMoe":\n'
      "            module.forward = types.MethodType(llama4_moe_forward, module)\n", "",
      ("tests/test_moe.py", "-k", "own_tokens")),
    B("llama4_rows_unscaled", "Llama 4's routed rows miss their router score",
      "src/leantune/models/experts.py", "    rows = hidden_states[order // top_k] * scores.gather(1, chosen)",
      "    rows = hidden_states[order // top_k] + 0 * scores.gather(1, chosen)",
      ("tests/test_moe.py", "-k", "eager_one")),
    B("sink_key_silent", "gpt-oss's sink key scores nothing (its extra channel left at zero)",
      "src/leantune/models/sink_attention.py", "    sink_key[dim] = 1\n", "", ("tests/test_sink_attention.py",)),
    B("sink_column_masked", "a layer with a mask (a sliding window, padding) never sees the sink",
      "src/leantune/models/sink_attention.py", "    seen = mask.new_ones(", "    seen = mask.new_zeros(",
      ("tests/test_sink_attention.py",)),
    B("sinks_not_auto", "gpt-oss falls back to eager attention (batch x heads x seq x seq scores kept)",
      "src/leantune/models/attention.py", "        if SINKS in usable:\n            return SINKS\n", "",
      ("tests/test_sink_attention.py",)),
    B("host_embedding_counted", "the planner counts an embedding kept on the host as the device's bytes",
      "src/leantune/memory/tracker.py",
      "        self._elsewhere.update(id(p.untyped_storage()) for p in model.parameters() if getattr(p, ON_HOST, False))\n"
      "        self.register((p for p in model.parameters() if not getattr(p, ON_HOST, False)), \"parameter\")",
      "        self.register(model.parameters(), \"parameter\")", ("tests/test_host_kept.py",)),
    B("host_embedding_ignored", "--offload_embedding leaves the embedding on the device",
      "src/leantune/builders/model.py", "        offload_embedding(unwrap_model(model))", "        pass",
      ("tests/test_host_kept.py",)),
    B("host_experts_ignored", "--offload_experts leaves every expert tensor on the device",
      "src/leantune/builders/model.py", "    offload_experts(model, cfg.memory.offload_experts)", "",
      ("tests/test_host_kept.py", "-k", "experts")),
    B("host_views_counted", "a chunk sliced from a host-kept tensor is counted as the whole tensor on the device",
      "src/leantune/memory/tracker.py", "        if key in self._elsewhere:", "        if False:",
      ("tests/test_host_kept.py", "-k", "experts")),
    B("host_experts_unmarked", "host-kept expert tensors are counted as the device's weights",
      "src/leantune/models/quantized_experts.py", "            setattr(param, ON_HOST, True)", "            pass",
      ("tests/test_host_kept.py", "-k", "experts")),
    B("host_rows_stay", "an embedding kept on the host hands its rows to the device's layers on the host",
      "src/leantune/models/host_embedding.py", "    return rows.to(device, non_blocking=True)", "    return rows",
      ("tests/test_host_kept.py", "-k", "hooks")),
    B("llama4_router_lora", "--lora_router on Llama 4 dies inside peft (its router returns a tuple)",
      "src/leantune/models/loading.py", '    if cfg.lora_router and any(type(m).__name__ == "Llama4Router"',
      '    if False and any(type(m).__name__ == "Llama4Router"', ("tests/test_moe.py", "-k", "router_flag")),
    B("experts_loaded_16bit", "4-bit experts load in 16 bits again (the whole layer stack on the device first)",
      "src/leantune/models/quantized_experts.py",
      "        if name not in EXPERT_TENSORS or param is None or param.dim() != 3 or param.is_meta or \\",
      "        if True or \\", ("tests/test_moe.py", "-k", "as_they_load")),
    B("experts_loaded_reinitialised", "an expert tensor quantized as it loads is not marked initialised",
      "src/leantune/models/quantized_experts.py",
      "        quantized._is_hf_initialized = True  # transformers would initialise it again otherwise\n", "",
      ("tests/test_moe.py", "-k", "as_they_load")),
    B("experts_packed_shape_to_peft", "peft sees a 4-bit expert tensor's packed 2-D shape when it attaches LoRA",
      "src/leantune/builders/model.py", "        with expert_shapes_for_peft(model):", "        with contextlib.nullcontext():",
      ("tests/test_moe.py", "-k", "as_they_load")),
    B("experts_missing_packed", "an expert tensor the checkpoint lacks is packed from uninitialised memory as it loads",
      "src/leantune/models/quantized_experts.py", '                not getattr(param, "_is_hf_initialized", False):',
      "                False:", ("tests/test_moe.py", "-k", "lacks")),
    B("host_chunk_not_copied", "a host-kept chunk goes to the dequantization as the host's own bytes (no copy)",
      "src/leantune/models/quantized_experts.py", "        part = part.to(scales.device, copy=True, non_blocking=True)",
      "        part = part.to(scales.device, non_blocking=True)", ("tests/test_moe.py", "-k", "host_kept")),
    B("tiled_moe_block", "--tiled_mlp tiles a mixture of experts' block (a strided tile it cannot view; the router's "
      "logits per tile)", "src/leantune/models/tiled_mlp.py",
      "    if not isinstance(mlp, torch.nn.Module) or any(is_router(module) for module in mlp.modules()):",
      "    if not isinstance(mlp, torch.nn.Module):", ("tests/test_moe.py", "-k", "tiles_leave or longest_context")),
    B("composite_window_unread", "an image-and-text config's sliding window is read from the composite (none): varlen "
      "is chosen and dies at step 1", "src/leantune/models/attention.py",
      "    config = text_config(config)  # a composite (image and text) config: its language model's fields\n", "",
      ("tests/test_image_text_models.py",)),
    B("vision_tower_lora", "LoRA on an image-and-text model's vision tower, which text rows never run (its pairs stay "
      "at their start)", "src/leantune/models/loading.py",
      "    beside = outside_the_language_model(model)\n", "    beside = []\n", ("tests/test_image_text_models.py",)),
    B("grouped_4bit_kept", "a 4-bit layer's experts keep the input's dequantized weight for backward",
      "src/leantune/models/quantized_experts.py", "    ctx.save_for_backward(packed, absmax, offsets, *nested)",
      "    ctx.save_for_backward(packed, absmax, offsets, *nested, _experts_dequantized(packed, _block_scales(absmax, "
      "*nested), shape, blocksize, quant_type, x.dtype, 0, shape[0], transpose))",
      ("tests/test_moe.py", "-k", "keep_no_dequantized")),
    B("experts_whole_tensor", "a 4-bit layer's whole expert tensor is dequantized at once",
      "src/leantune/models/quantized_experts.py", "    return max(1, min(shape[0], EXPERT_CHUNK_BYTES // per_expert))",
      "    return shape[0]", ("tests/test_moe.py", "-k", "chunk_at_a_time")),
    B("experts_chunk_layout", "experts whose rows are not whole blocks are sliced as if they were",
      "src/leantune/models/quantized_experts.py", "    if shape[2] % BLOCK:\n        return shape[0]\n", "",
      ("tests/test_moe.py", "-k", "4bit_experts_equal")),
    B("experts_chunk_rows", "each chunk's rows are given the offsets of the whole batch",
      "src/leantune/models/quantized_experts.py", "offsets[start:stop] - first)", "offsets[start:stop])",
      ("tests/test_moe.py", "-k", "chunk_at_a_time or 4bit_experts_equal")),
    B("experts_replay_whole", "the planner's trace counts a whole dequantized tensor where the run holds a chunk",
      "src/leantune/models/quantized_experts.py",
      "    weight = _experts_dequantized(packed, scales, shape, blocksize, quant_type, dtype, 0, chunk, transpose, host)",
      "    weight = _experts_dequantized(packed, scales, shape, blocksize, quant_type, dtype, 0, shape[0], transpose, "
      "host)",
      ("tests/test_moe.py", "-k", "chunk_at_a_time")),
    B("quantized_factors_uint8", "LoRA factors on a 4-bit expert tensor cast to its packed bytes' dtype",
      "src/leantune/models/experts.py", "    return lhs.to(state.dtype), rhs.to(state.dtype), wrapper.scaling[adapter]",
      "    return lhs.to(torch.uint8).to(state.dtype), rhs.to(state.dtype), wrapper.scaling[adapter]",
      ("tests/test_moe.py", "-k", "4bit_experts_equal")),
    B("linear4bit_bias_meta", "the measured 4-bit model's biases stay on meta (Qwen2's QLoRA plan cannot be checked)",
      "src/leantune/models/quantized.py", "            if bias is not None:  # the converted layer's bias",
      "            if False:  # the converted layer's bias", ("tests/test_qlora.py", "-k", "biased")),
    B("experts_quant_type_fixed", "--quant_type and --use_double_quant do not reach the experts",
      "src/leantune/models/quantized_experts.py",
      "    return dict(blocksize=BLOCK, compress_statistics=quant.use_double_quant, quant_type=quant.quant_type,",
      '    return dict(blocksize=BLOCK, compress_statistics=True, quant_type="nf4",',
      ("tests/test_moe.py", "-k", "quant_type")),
    B("experts_state_bytes", "the start-up line leaves the experts' scales out of their bytes",
      "src/leantune/models/quantized_experts.py", "    if state is None:\n        return 0\n    tensors",
      "    if True:\n        return 0\n    tensors", ("tests/test_moe.py", "-k", "quant_type")),
    B("train_perplexity_with_router", "the epoch's train perplexity includes the router's term",
      "src/leantune/training/loop.py", '"train_perplexity": lines.perplexity(cross_entropy)',
      '"train_perplexity": lines.perplexity(train_loss)', ("tests/test_moe.py", "-k", "accumulated")),
    B("moe_merge_unmerged", "leantune merge saves an expert adapter's base without folding the adapter in",
      "src/leantune/models/merging.py", "    model = PeftModel.from_pretrained(model, str(run_dir)).merge_and_unload()\n",
      "", ("tests/test_moe.py", "-k", "merges_as_peft")),
    B("moe_merge_dtype", "an expert adapter's merged model is saved in float32 whatever the base's dtype",
      "src/leantune/models/merging.py", "    model.to(wanted).save_pretrained(out)", "    model.save_pretrained(out)",
      ("tests/test_moe.py", "-k", "merges_as_peft")),
    B("moe_merge_in_bf16", "an expert adapter is merged in the base's bfloat16, rounding the sum twice",
      "src/leantune/models/merging.py",
      "    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)",
      "    model = AutoModelForCausalLM.from_pretrained(base_dir)", ("tests/test_moe.py", "-k", "merges_as_peft")),
    # issue 54: the first GPU run on the image as it is, and the GPU paths' defects
    B("varlen_op_recomputed", "selective_ops recomputes PyTorch's varlen flash attention in backward",
      "src/leantune/checkpointing/selective.py", "    return _packet(op) in _ATTENTION or _op_name(op) in VARLEN_ATTENTION",
      "    return _packet(op) in _ATTENTION", ("tests/test_selective_ops.py", "-k", "varlen")),
    B("varlen_mixed_dtypes", "under autocast q and k reach the flash kernel as float32 (full fine-tuning falls back "
      "to SDPA per example)", "src/leantune/models/varlen_attention.py",
      "    query, key, value = in_one_dtype(query, key, value)\n", "",
      ("tests/test_long_context.py", "-k", "autocast")),
    B("varlen_scale_unchecked", "the flash call passes scale= to a kernel that has no such keyword",
      "src/leantune/models/varlen_attention.py", '    if "scale" in accepts:\n        keywords["scale"] = scaling',
      '    if True:\n        keywords["scale"] = scaling', ("tests/test_long_context.py", "-k", "flash_call")),
    B("varlen_no_causal_check", "a kernel with no way to say causal is used anyway",
      "src/leantune/models/varlen_attention.py",
      "    return kernel is not None and _causal_keyword(_parameters(kernel)) is not None",
      "    return kernel is not None", ("tests/test_long_context.py", "-k", "cannot_say_causal")),
    B("cu_seqlens_every_call", "cu_seqlens are built again in every layer's attention call",
      "src/leantune/models/varlen_attention.py", "        if key not in self._on_device:", "        if True:",
      ("tests/test_long_context.py", "-k", "cu_seqlens")),
    B("stream_zero_unordered", "a step from FSDP2's reduce-scatter stream is not ordered after the gradient",
      "src/leantune/optimizers/streams.py", "    default.wait_stream(current)\n", "",
      ("tests/test_sharded_8bit.py", "-k", "side_stream")),
    B("step_off_stream_zero", "a step from a side stream runs torch's part of it (state made, gradient made "
      "contiguous) on that stream while bitsandbytes' kernel runs on stream 0",
      "src/leantune/optimizers/streams.py", "        with torch.cuda.stream(default):\n            yield\n",
      "        yield\n", ("tests/test_sharded_8bit.py", "-k", "side_stream")),
    B("step_in_backward_unordered", "the step in backward is not run inside the streams' ordering",
      "src/leantune/training/in_backward.py", "        with without_bitsandbytes_sync(), on_the_default_stream(param.device):",
      "        with without_bitsandbytes_sync():", ("tests/test_lean_optimizers.py", "-k", "never_wait")),
    B("tiles_sum_in_bf16", "the tiled MLP sums bfloat16 weight gradients in bfloat16, rounding at every tile",
      "src/leantune/models/tiled_mlp.py", "    return grad.float()\n", "    return grad\n",
      ("tests/test_long_context.py", "-k", "float32")),
    B("max_context_no_pool_cap", "--max_context suggests offload without the pinned-pool cap its plan needs",
      "src/leantune/planning/max_context.py",
      '    if levers["activation_checkpointing_mode"] == "offload" and plan is not None and plan.offload_pool_bytes:',
      "    if False:", ("tests/test_max_context.py", "-k", "pool_cap")),
    B("offload_pool_unplanned", "the offload plan does not record the pinned pool it holds",
      "src/leantune/planning/plan.py", "        plans[OFFLOAD].offload_pool_bytes = pinned\n", "",
      ("tests/test_planning.py", "-k", "offload_is_derived")),
    B("gqa_flops_refused", "on torch 2.11 every plan of a model with grouped heads stops in the FLOP formula",
      "src/leantune/planning/flop_tracker.py",
      "        return sdpa_flop_count(query, *_with_query_heads(query, key, value))",
      "        return sdpa_flop_count(query, key, value)", ("tests/test_planning.py", "-k", "grouped_heads")),
    B("gpu_check_no_version_stub", "gpu_check writes nothing before its needs are checked",
      "benchmarks/gpu_check.py",
      '    write_json(args.out / "gpu_check.json", result)  # first: whatever happens next, the versions come back\n',
      "", ("tests/test_gpu_check.py", "-k", "written_before")),
    B("gpu_check_extras_asked", "gpu_check asks for requirements of extras it does not need",
      "benchmarks/gpu_check_env.py",
      '        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):\n            continue\n',
      "", ("tests/test_gpu_check.py", "-k", "missing_or_old")),
    B("wheel_without_cpu_library", "the carried bitsandbytes wheel loses its CPU library",
      "benchmarks/gpu_wheels.py", '    keep = {f"libbitsandbytes_cuda{cuda}.so", "libbitsandbytes_cpu.so"}',
      '    keep = {f"libbitsandbytes_cuda{cuda}.so"}', ("tests/test_gpu_check.py", "-k", "carried")),
    B("gpu_check_no_cuda_check", "gpu_check on a machine without a GPU starts its parts anyway",
      "benchmarks/gpu_check_env.py", "        if count == 0:", "        if False:",
      ("tests/test_gpu_check.py", "-k", "without_a_gpu")),
    # issue 53: batches of images and text
    B("images_dropped", "an image batch runs the decoder on its ids alone", "src/leantune/training/step.py",
      "    if images:\n        base = image_text_base(model)", "    if False:\n        base = image_text_base(model)",
      ("tests/test_image_batches.py", "-k", "every_gradient")),
    B("image_inputs_lost", "the batch's pixel values never leave the loader", "src/leantune/training/step.py",
      "    if not extra:\n        return None", "    if True:\n        return None",
      ("tests/test_image_batches.py", "-k", "cookbook or learns")),
    B("gemma3_labels_kept", "Gemma 3's base is not handed the labels its class hands it", "src/leantune/training/step.py",
      '    return base is not None and "labels" in inspect.signature(base.forward).parameters', "    return False",
      ("tests/test_image_batches.py", "-k", "every_gradient")),
    B("pixels_unchecked", "the self-check lets a class change the pixels before its base",
      "src/leantune/builders/own_loss.py",
      '        self.unexpected += [f"not {name} as given" for name in self.images if kwargs.get(name) is not self.images[name]]',
      "", ("tests/test_image_batches.py", "-k", "self_check")),
    B("image_text_loaded_as_causal_lm", "Llama 3.2 Vision loads as its text-only causal LM", "src/leantune/models/loading.py",
      "    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM",
      "    return AutoModelForCausalLM", ("tests/test_image_batches.py", "-k", "cookbook")),
    B("collator_ignored", "a vision dataset file's collator is never used", "src/leantune/builders/loaders.py",
      "        collator = data_collator(file, processor) if file and processor is not None else None",
      "        collator = None", ("tests/test_image_batches.py", "-k", "cookbook")),
    B("vision_packing_allowed", "packing is not refused for collated image rows", "src/leantune/builders/loaders.py",
      '        if data.batching_strategy == "packing":\n            raise DatasetError(f"--batching_strategy packing',
      '        if False:\n            raise DatasetError(f"--batching_strategy packing',
      ("tests/test_image_batches.py", "-k", "refused_by_name")),
    B("collated_overlong", "collated rows over --context_length pass", "src/leantune/data/collated.py",
      "    if ids.shape[1] > context_length:", "    if False:",
      ("tests/test_image_batches.py", "-k", "broken_collator")),
    B("planner_counts_images", "the planner plans image runs as text rows", "src/leantune/preflight.py",
      "        if asks(cfg):\n            raise ConfigError(why)", "        pass",
      ("tests/test_image_batches.py", "-k", "refused_by_name")),
    B("freeze_keeps_cross_attention_frozen", "--freeze_LLM_only freezes the fusion layers too",
      "src/leantune/models/image_text.py",
      "    for layer in found.get(\"cross-attention\", []):\n        layer.requires_grad_(True)\n", "",
      ("tests/test_image_batches.py", "-k", "freeze")),
    B("freeze_ignored", "--freeze_LLM_only trains every weight", "src/leantune/builders/model.py",
      "    elif cfg.peft.freeze_LLM_only:\n        freeze_language_model(model)", "",
      ("tests/test_image_batches.py", "-k", "freeze")),
    B("vision_layers_not_checkpointed", "Llama 3.2 Vision's encoder layers are never checkpointed",
      "src/leantune/builders/model.py",
      "        checkpointable_vision_layers(model)  # Llama 3.2 Vision's encoder layers, checkpointed as the decoder's",
      "        pass", ("tests/test_image_batches.py", "-k", "checkpointing")),
    B("processor_not_saved", "an image run saves its tokenizer without its processor", "src/leantune/finetuning.py",
      "    return confirmed, model, processor if processor is not None else tokenizer, loaders, checkpoint",
      "    return confirmed, model, tokenizer, loaders, checkpoint", ("tests/test_image_batches.py", "-k", "cookbook")),
    B("llama4_images_accepted", "a class that embeds its images itself is not refused", "src/leantune/models/image_text.py",
      "    if is_image_text(model.config) and image_text_base(model) is None:", "    if False:",
      ("tests/test_image_batches.py", "-k", "embeds_the_images")),
]


def scratch_copy(into: Path) -> None:
    """The checkout's files (tracked, and untracked ones git does not ignore) copied to ``into``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def run_tests(tests: tuple[str, ...], scratch: Path) -> int:
    """pytest's exit code for ``tests`` in ``scratch`` (its ``src`` first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=scratch,
                          env=env, capture_output=True, text=True).returncode


def try_one(breakage: Breakage, scratch: Path, clean: dict) -> tuple[str, float]:
    """Apply ``breakage`` in ``scratch``, run its tests there, put the file back: caught, MISSED, stale, or
    "fails unbroken" when the same tests fail without it (``clean``: each selection's unbroken exit code)."""
    path = scratch / breakage.file
    original = path.read_text()
    if original.count(breakage.old) != 1:
        return "stale", 0.0
    started = time.perf_counter()
    if breakage.tests not in clean:  # a selection that fails unbroken would call every breakage caught
        clean[breakage.tests] = run_tests(breakage.tests, scratch)
    if clean[breakage.tests] != 0:
        return "fails unbroken", time.perf_counter() - started
    path.write_text(original.replace(breakage.old, breakage.new))
    try:
        code = run_tests(breakage.tests, scratch)
    finally:
        path.write_text(original)
    # pytest's 1 is "tests failed": caught; 5 (nothing collected) or another error is not a catch
    status = "caught" if code == 1 else "MISSED" if code == 0 else f"error {code}"
    return status, time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names")
    parser.add_argument("--list", action="store_true", help="name each breakage and stop")
    args = parser.parse_args(argv)
    chosen = BREAKAGES
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {b.name for b in BREAKAGES})
        if unknown:
            parser.error(f"--only: unknown {', '.join(unknown)}")
        chosen = [b for b in BREAKAGES if b.name in names]
    if args.list:
        print("\n".join(f"{b.name:<24} {b.why}" for b in chosen))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="leantune-breakages-") as folder:
        scratch = Path(folder)
        scratch_copy(scratch)
        clean: dict = {}
        for breakage in chosen:
            status, seconds = try_one(breakage, scratch, clean)
            results.append((breakage, status))
            print(f"{breakage.name:<24} {status:<8} {seconds:6.1f} s  {breakage.why}", flush=True)
    missed = [b.name for b, status in results if status != "caught"]
    print(f"\n{len(results) - len(missed)} of {len(results)} caught" + (f"; not caught: {', '.join(missed)}"
                                                                      if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
