"""``--compile``: every decoder layer compiled in place, the run's losses those of the same run eager.

Compiling costs tens of seconds a graph on a CPU, so the cases are few and share their graphs:
compiled layers of one structure are reused by every later run in this process.
"""

from __future__ import annotations

import pytest
import torch

from leantune.checkpointing.recomputed_linear import RecomputedLinear
from leantune.flags import parse_run_config
from leantune.config import ConfigError
from leantune.finetuning import run
from leantune.models import compiling
from test_distributed import DIST_GRAD_NORM_RTOL, DIST_LOSS_TOL, FAST, step_losses

CASES = {
    # LoRA dropout: compiled, its masks must still be torch's (fallback_random); lora_B and down_proj's
    # adapter recomputed by selective_ops' policy, traced.
    "lora, selective_ops, dropout": ["--use_peft", "--lora_dropout", "0.1", "--lora_target_modules",
                                     "q_proj,v_proj,down_proj", "--enable_activation_checkpointing",
                                     "--activation_checkpointing_mode", "selective_ops"],
    # one layer checkpointed, one not (two graphs), sharded by FSDP2 after compiling, clipped
    "full FT, every_n, one-process FSDP": ["--enable_activation_checkpointing", "--activation_checkpointing_mode",
                                           "every_n", "--enable_fsdp", "--gradient_clipping"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_compiled_run_gives_the_losses_of_the_same_run_eager(case, tiny_model_dir, tmp_path):
    # --compile takes sdpa and no tiles (varlen's spans would recompile the layers): the eager run the same
    common = ["--model_name", str(tiny_model_dir), *FAST, *CASES[case], "--batch_size_training", "2",
              "--max_train_step", "3", "--attn_implementation", "sdpa", "--tiled_mlp", "off"]
    logs: list[str] = []
    run(parse_run_config([*common, "--output_dir", str(tmp_path / "eager")]), log=lambda _: None)
    run(parse_run_config([*common, "--compile", "--output_dir", str(tmp_path / "compiled")]), log=logs.append)
    assert any(line.startswith("compile: torch.compile on each of the 2 decoder layers") for line in logs)
    compiled_lines = [line for line in logs if line.startswith("compile: step 1 took")]
    # Known, not yet understood: after earlier tests in the same process (the whole suite, not this file alone)
    # step 1 reports 9 graph breaks at a torch.compiler.disable()'d function; the losses below still hold.
    assert len(compiled_lines) == 1, compiled_lines
    eager, compiled = step_losses(tmp_path / "eager"), step_losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) >= 2
    assert compiled == pytest.approx(eager, rel=0, abs=DIST_LOSS_TOL)
    norms = step_losses(tmp_path / "eager", "grad_norm"), step_losses(tmp_path / "compiled", "grad_norm")
    assert norms[1] == pytest.approx(norms[0], rel=DIST_GRAD_NORM_RTOL, abs=0)


def test_compiled_layers_keep_their_names_and_selective_ops_its_marked_linears(tiny_model_dir):
    from leantune.builders.model import build_model
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(tiny_model_dir), *CASES["lora, selective_ops, dropout"], "--compile"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lambda _: None)
    names = [name for name, _ in model.named_parameters()]
    line = compiling.compile_decoder_layers(model)
    assert line.startswith("compile: torch.compile on each of the 2 decoder layers")
    assert [name for name, _ in model.named_parameters()] == names  # compiled in place: no wrapper, no new prefix
    layers = model.get_base_model().model.layers
    # every one, the last too
    assert [layer._compiled_call_impl is not None for layer in layers] == [True] * len(layers)
    assert type(layers[0].self_attn.q_proj.lora_B["default"]) is RecomputedLinear


def test_compile_without_a_cpp_compiler_is_refused_before_anything_loads(monkeypatch):
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"--compile: torch.compile on the CPU builds C\+\+ code.*apt install g\+\+"):
        compiling.check_can_compile("cpu")
    # on a GPU, Triton builds each kernel's launcher with a C compiler
    with pytest.raises(ConfigError, match=r"on the CUDA builds C code, and no C compiler was found \(gcc, cc, clang"):
        compiling.check_can_compile("cuda")


def test_the_compile_line_reports_torchs_time_and_graph_breaks():
    metrics = {"_compile.compile_inner": [4.0, 1.5], "compile_fx.<locals>.bw_compiler": [2.0]}
    counters = {"stats": {"unique_graphs": 2}, "graph_break": {"Unsupported: a call\nmore": 3}}
    line = compiling.compile_line(1, 9.25, metrics, counters)
    assert line == ("compile: step 1 took 9.2 s, 7.5 s of it compiling 2 graph(s); 3 graph break(s), where the "
                    "layers run eagerly: e.g. Unsupported: a call (TORCH_LOGS=graph_breaks shows each)")
    resumed = compiling.compile_line(5, 3.0, {}, {"stats": {}, "graph_break": {}})  # the first step of a resumed run
    assert resumed == "compile: step 5 took 3.0 s (0 graph(s))"


def test_offload_is_refused_with_compile_and_left_out_of_autos_candidates():
    with pytest.raises(ConfigError, match="--compile: not with --activation_checkpointing_mode offload"):
        parse_run_config(["--compile", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                          "offload"])
    from leantune.checkpointing.modes import planned_modes

    from leantune.planning.plan import modes_to_plan

    assert "offload" in planned_modes(on_gpu=True)
    assert planned_modes(on_gpu=True, compiled=True) == [m for m in planned_modes(on_gpu=True) if m != "offload"]
    auto = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", "auto"]
    gpu = torch.device("cuda")
    assert "offload" in modes_to_plan(parse_run_config(auto).checkpointing, gpu, compiled=False)
    compiled = parse_run_config([*auto, "--compile"])
    assert "offload" not in modes_to_plan(compiled.checkpointing, gpu, compiled=compiled.training.compile)


def test_the_plan_says_it_plans_the_eager_step(tiny_model_dir, capsys):
    from leantune.planning.plan_command import main as plan_main
    from leantune.planning.table import COMPILE_NOTE

    assert plan_main(["--model_name", str(tiny_model_dir), "--context_length", "128", "--compile"]) == 0
    assert COMPILE_NOTE in capsys.readouterr().out


def test_the_out_of_memory_advice_does_not_offer_offload_to_a_compiled_run():
    from leantune.planning.oom_advice import memory_fixes

    flags = ["--enable_activation_checkpointing", "--activation_checkpointing_mode", "selective_ops"]
    offered = [memory_fixes(parse_run_config([*flags, *extra]), torch.device("cuda")) for extra in ([], ["--compile"])]
    assert [any("--activation_checkpointing_mode offload" in fix for fix in fixes)
            for fixes in offered] == [True, False]


def test_a_checkpointed_layers_compiled_call_holds_its_checkpoint(tiny_model_dir, monkeypatch):
    """What ``nn.Module.compile`` compiles (the layer's ``_call_impl``), traced by dynamo: the checkpoint with its
    selective policy is one op of the graph, not an eager wrapper around it."""
    from leantune.builders.model import build_model
    from leantune.model_structure import decoder_layers
    from leantune.precision import choose_precision

    cfg = parse_run_config(["--model_name", str(tiny_model_dir), *CASES["lora, selective_ops, dropout"],
                            "--attn_implementation", "sdpa", "--tiled_mlp", "off"])
    model, _ = build_model(cfg, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                           log=lambda _: None)
    layer = decoder_layers(model)[0]
    compiling.check_checkpoint_inside(decoder_layers(model))  # this transformers checkpoints the forward
    seen = {}
    handle = layer.register_forward_pre_hook(lambda _m, args, kwargs: seen.update(args=args, kwargs=kwargs),
                                             with_kwargs=True)
    model.train()
    model(input_ids=torch.randint(0, 100, (1, 16)))
    handle.remove()
    graphs = []

    def record(graph_module, _inputs):
        graphs.append(graph_module)
        return graph_module.forward

    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", True)  # as compiling
    torch._dynamo.reset()  # ``Module._call_impl`` is one code object: the earlier tests' graphs fill its cache
    torch.compile(layer._call_impl, backend=record)(*seen["args"], **seen["kwargs"])
    targets = {node.target for graph in graphs for node in graph.graph.nodes}
    assert torch.ops.higher_order.tag_activation_checkpoint in targets
    torch._dynamo.reset()


def test_a_layer_checkpointed_around_its_call_is_refused_with_compile():
    """Older transformers checkpointed around ``__call__``: nn.Module.compile would leave the checkpoint out."""
    class CheckpointedAroundItsCall(torch.nn.Linear):
        gradient_checkpointing = True

        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    with pytest.raises(ConfigError, match=r"CheckpointedAroundItsCall \(transformers .*\) checkpoints around its "
                                          r"__call__, outside what torch.compile compiles.*Upgrade transformers"):
        compiling.check_checkpoint_inside([CheckpointedAroundItsCall(2, 2)])
    unchecked = CheckpointedAroundItsCall(2, 2)
    unchecked.gradient_checkpointing = False
    compiling.check_checkpoint_inside([unchecked, torch.nn.Linear(2, 2)])  # nothing checkpointed there: compiled
    # and compiling a model's layers asks it first, before compiling any
    layer = CheckpointedAroundItsCall(2, 2)
    with pytest.raises(ConfigError, match="checkpoints around its __call__"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compiling, "decoder_layers", lambda model: [layer])
            compiling.compile_decoder_layers(torch.nn.Module())
    assert layer._compiled_call_impl is None
