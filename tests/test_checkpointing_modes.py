"""every_n, selective_ops and offload: exact gradients, what is in force, memory between the extremes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from leantune.checkpointing import (CheckpointingError, EveryNLayers, FullCheckpointing, LayerMix,
                                    OffloadCheckpointing, SelectiveOps, apply_activation_checkpointing)
from leantune.checkpointing.modes import (MODES, declared_flags, mode_choices, planned_modes, policy_class,
                                         policy_from_config, recompute_rank)
from leantune.flags import build_parser, parse_run_config
from leantune.checkpointing.selective import recomputed_linears
from leantune.loss import ChunkedCrossEntropy

from helpers import ImmediateStreams, activation_bytes, assert_same_gradients, gradients, make_batch, with_lora

POLICIES = {
    "full": lambda: FullCheckpointing(),
    "every_n": lambda: EveryNLayers(n=2),
    "every_n_reentrant": lambda: EveryNLayers(n=2, use_reentrant=True),
    "selective_ops": lambda: SelectiveOps(),
    # the offloader's bookkeeping with host copies on a CPU-only machine: its streams stood in
    "offload": lambda: OffloadCheckpointing(min_bytes=0, streams=ImmediateStreams()),
    "layer_mix": lambda: LayerMix(layers=("full", "selective_ops")),  # the test model has two layers
}


def _pair(load_tiny, use_lora):
    plain, checkpointed = load_tiny(), load_tiny()
    if use_lora:
        plain, checkpointed = with_lora(plain), with_lora(checkpointed)
    return plain, checkpointed


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_every_mode_gives_exactly_the_plain_gradients(load_tiny, use_lora, mode):
    plain, checkpointed = _pair(load_tiny, use_lora)
    apply_activation_checkpointing(checkpointed, POLICIES[mode]())
    assert_same_gradients(plain, checkpointed)


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
def test_modes_sit_between_none_and_full_in_memory(load_tiny, use_lora):
    ids, _ = make_batch(load_tiny().config.vocab_size, batch=2, seq=256)
    live = {}
    for mode in ("none", "full", "every_n", "selective_ops"):
        model = with_lora(load_tiny()) if use_lora else load_tiny()
        if mode != "none":
            apply_activation_checkpointing(model, POLICIES[mode]())
        live[mode] = activation_bytes(model, ids)[0]
    assert live["full"] < live["every_n"] < live["none"]
    assert live["full"] < live["selective_ops"] < live["none"]
    # LoRA-aware selective checkpointing keeps well under the no-checkpointing activations.
    assert live["selective_ops"] <= 0.75 * live["none"], live


def test_summary_lines_name_layers_and_policy(load_tiny):
    every = apply_activation_checkpointing(load_tiny(), EveryNLayers(n=2)).summary_line()
    assert every == "activation checkpointing: on, 1/2 decoder layers (0), non-reentrant, policy every_n (1 in 2)"
    selective = apply_activation_checkpointing(load_tiny(), SelectiveOps()).summary_line()
    assert selective.startswith("activation checkpointing: on, 2/2 decoder layers, non-reentrant, policy selective_ops")
    assert selective.endswith("(save attention + projections; recompute elementwise ops, down_proj)")  # full FT
    lora = apply_activation_checkpointing(with_lora(load_tiny()), SelectiveOps()).summary_line()
    assert lora.endswith("policy selective_ops (save attention + projections; recompute elementwise ops, lora_B)")
    offload = apply_activation_checkpointing(load_tiny(),
                                             OffloadCheckpointing(streams=ImmediateStreams())).summary_line()
    assert "policy offload (layer inputs >= 1 MiB to pinned host memory)" in offload


def test_selective_policy_finds_the_recomputed_modules(load_tiny):
    """Full fine-tuning recomputes down_proj (its backward is costly anyway); LoRA recomputes only lora_B."""
    assert recomputed_linears(load_tiny()) == {f"model.layers.{i}.mlp.down_proj": "down_proj" for i in range(2)}
    lora = recomputed_linears(with_lora(load_tiny()))  # q_proj, v_proj and down_proj carry adapters
    assert set(lora.values()) == {"lora_B"} and len(lora) == 3 * 2
    assert all(name.endswith(".lora_B.default") for name in lora)


def test_offload_is_refused_without_an_accelerator(load_tiny):
    with pytest.raises(CheckpointingError, match="on a CPU-only machine they already live in host memory"):
        apply_activation_checkpointing(load_tiny(), OffloadCheckpointing())


@pytest.mark.parametrize("policy", [lambda: SelectiveOps(use_reentrant=True),
                                    lambda: OffloadCheckpointing(use_reentrant=True)])
def test_reentrant_is_refused_where_it_cannot_work(policy):
    with pytest.raises(ValueError, match="non-reentrant"):
        policy()


def test_unknown_mode_name():
    with pytest.raises(ValueError, match="unknown activation checkpointing mode 'some'"):
        policy_class("some")


def test_modes_combine_with_the_chunked_loss(load_tiny):
    plain, checkpointed = _pair(load_tiny, use_lora=True)
    apply_activation_checkpointing(checkpointed, SelectiveOps())
    ids, labels = make_batch(plain.config.vocab_size)
    expected = gradients(plain, ids, labels)
    actual = gradients(checkpointed, ids, labels, loss_fn=ChunkedCrossEntropy(37))
    # Equal within float32 rounding, not exactly: the chunked loss sums in another order. Measured
    # per tensor, as a relative norm (single entries that cancel to near zero differ more).
    for name in expected:
        error = (actual[name] - expected[name]).norm() / expected[name].norm()
        assert error < 1e-5, (name, float(error))


@pytest.mark.parametrize("use_lora", [False, True], ids=["full-ft", "lora"])
def test_a_layer_mix_sits_between_its_parts(load_tiny, use_lora):
    ids, _ = make_batch(load_tiny().config.vocab_size, batch=2, seq=256)
    live = {}
    for name, layers in {"full": ("full", "full"), "mix": ("full", "selective_ops"),
                         "selective": ("selective_ops", "selective_ops"), "half": ("none", "full")}.items():
        model = with_lora(load_tiny()) if use_lora else load_tiny()
        report = apply_activation_checkpointing(model, LayerMix(layers=layers))
        live[name] = activation_bytes(model, ids)[0]
        if name == "half":
            assert report.layer_indices == (1,) and "layer_mix (none=1,full=1)" in report.summary_line()
    assert live["full"] < live["mix"] < live["selective"]


def test_layer_mix_flags_and_errors(load_tiny):
    from leantune.checkpointing.modes.layer_mix import format_layer_mix, parse_layer_mix
    from leantune.config import ConfigError

    assert parse_layer_mix("full=2, selective_ops=1,none=1") == ("full", "full", "selective_ops", "none")
    assert format_layer_mix(("full", "full", "selective_ops")) == "full=2,selective_ops=1"
    cfg = parse_run_config(["--enable_activation_checkpointing", "--activation_checkpointing_layers", "full=2"])
    assert cfg.checkpointing.mode == "layer_mix"
    for argv, message in [
        (["--enable_activation_checkpointing", "--activation_checkpointing_layers", "most=3"], "CHOICE=COUNT"),
        (["--enable_activation_checkpointing", "--activation_checkpointing_mode", "layer_mix"], "needs the choice"),
        (["--activation_checkpointing_layers", "full=2"], "without --enable_activation_checkpointing"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_run_config(argv)
    with pytest.raises(CheckpointingError, match="names 3 layers, the model has 2"):
        apply_activation_checkpointing(load_tiny(), LayerMix(layers=("full",) * 3))


OWN_FLAG_VALUES = {"activation_checkpointing_every_n": "3", "activation_checkpointing_layers": "full=1,none=1",
                   "activation_offload_max_pinned_gb": "1.5"}


def test_every_registered_mode_is_offered_documented_and_built_from_its_flags():
    """The registry is the one list of modes: the flag offers each, the docs describe each, its flags build it."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "activation_checkpointing_modes.md").read_text()
    choices = next(a.choices for a in build_parser()._actions if "--activation_checkpointing_mode" in a.option_strings)
    assert tuple(choices) == mode_choices() == (*MODES, "auto")
    for name, cls in MODES.items():
        assert f"| `{name}`" in docs, f"{name}: add its row to docs/activation_checkpointing_modes.md"
        flags = [f for flag in cls.flags for f in (f"--{flag.name}", OWN_FLAG_VALUES[flag.name])]
        cfg = parse_run_config(["--enable_activation_checkpointing", "--activation_checkpointing_mode", name, *flags])
        policy = policy_from_config(cfg.checkpointing)
        assert type(policy) is cls and policy.name == name
        assert (name in planned_modes(on_gpu=True)) == cls.planned
        assert (name in planned_modes(on_gpu=False)) == (cls.planned and not cls.gpu_only)
    assert planned_modes(on_gpu=True) == ["none", "full", "every_n", "selective_ops", "offload"]
    # each mode's own flags are its module's alone: the config's section names none of them (nor any mode)
    from leantune.config import checkpointing as section

    assert sorted(OWN_FLAG_VALUES) == sorted(declared_flags())
    assert [name for name in (*declared_flags(), *MODES) if name in _code_words(Path(section.__file__))] == []


def _code_words(path: Path) -> set[str]:
    """The names and the words of the strings in a module's code (its docstrings and comments left out)."""
    tree = ast.parse(path.read_text())
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, documented)
                  and ast.get_docstring(node) is not None}
    words = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    words |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words |= set(re.findall(r"\w+", node.value))
    return words


def test_a_policy_class_registers_its_mode_as_it_is_defined(monkeypatch):
    """Adding a mode is its class alone: defining it puts it in the registry, listed by its ``order`` (last
    without one); a name defined twice is refused, and so is a flag another mode declares; a subclass without a
    name of its own stays its parent's mode."""
    from leantune.checkpointing import ModeFlag, registry

    monkeypatch.setattr(registry, "MODES", dict(MODES))
    every_third = type("EveryThird", (registry.CheckpointPolicy,), {"name": "every_third", "summary": "one in 3",
                                                                    "selects_layer": lambda self, i: i % 3 == 0})
    assert list(registry.MODES)[-1] == "every_third" and registry.MODES["every_third"] is every_third
    type("Quieter", (every_third,), {})
    assert registry.MODES["every_third"] is every_third
    with pytest.raises(ValueError, match="'every_third' defined twice"):
        type("Again", (registry.CheckpointPolicy,), {"name": "every_third"})
    type("Second", (registry.CheckpointPolicy,), {"name": "second", "order": 1})
    assert list(registry.MODES)[:3] == ["full", "every_n", "second"]  # ties: as registered
    with pytest.raises(ValueError, match="declares --activation_checkpointing_every_n, which mode 'every_n' declares"):
        type("Thief", (registry.CheckpointPolicy,), {"name": "thief", "flags": (ModeFlag(
            "activation_checkpointing_every_n", int, "taken"),)})


def _mode_config(name: str):
    own = [f for flag in MODES[name].flags for f in (f"--{flag.name}", OWN_FLAG_VALUES[flag.name])]
    return parse_run_config(["--model_name", "tiny", "--context_length", "128", "--batch_size_training", "2",
                             "--enable_activation_checkpointing", "--activation_checkpointing_mode", name, *own])


@pytest.mark.parametrize("name, suggests_full", [("full", False), ("every_n", True), ("selective_ops", True),
                                                 ("offload", False), ("layer_mix", True)])
def test_the_oom_advice_follows_each_modes_declaration(name, suggests_full):
    from leantune.planning.oom_advice import memory_fixes

    assert set(MODES) == {"full", "every_n", "selective_ops", "offload", "layer_mix"}  # a new mode: add its row
    fixes = memory_fixes(_mode_config(name), torch.device("cuda"))
    assert (f"recompute every layer: --activation_checkpointing_mode full (now {name})" in fixes) == suggests_full
    assert MODES[name].keeps_least == (not suggests_full)
    assert any("--activation_checkpointing_mode offload" in fix for fix in fixes) == (name != "offload")


def test_offload_counts_the_flops_of_full_and_ties_go_to_the_mode_that_recomputes_less():
    from leantune.models.presets import model_config
    from leantune.planning.flops import count_token_flops
    from leantune.planning.plan import ModePlan, choose_mode

    cuda, config = torch.device("cuda"), model_config("tiny")
    assert MODES["offload"].flops_as == "full"
    assert count_token_flops(_mode_config("offload"), config, cuda) == count_token_flops(_mode_config("full"), config,
                                                                                         cuda)
    # auto's tie-break: equal recompute FLOPs go to the mode that recomputes less by design
    assert sorted(planned_modes(on_gpu=True), key=recompute_rank) == ["none", "selective_ops", "every_n", "full",
                                                                      "offload"]
    tied = [ModePlan(mode, mode, "cuda", 2, 128, *([0] * 9), fits=True) for mode in ("full", "every_n", "offload",
                                                                                      "selective_ops")]
    assert choose_mode(tied).mode == "selective_ops"
    assert choose_mode([p for p in tied if p.mode != "selective_ops"]).mode == "every_n"


def test_the_reentrant_flag_reaches_the_policy_built_from_the_config():
    from leantune.checkpointing import policy_from_config
    from leantune.flags import parse_run_config

    def policy(*extra):
        return policy_from_config(parse_run_config(["--enable_activation_checkpointing", *extra]).checkpointing)

    assert policy("--activation_checkpointing_use_reentrant").use_reentrant is True
    assert policy().use_reentrant is False
