"""``auto`` with ``--auto_batch_size`` times one real step of each candidate and keeps the fastest.

Checkpointing is taken off and put on again between candidates: removing it must leave the model
exactly as it was, and the winner's checkpointing is what the model trains with.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from leantune.checkpointing.recomputed_linear import RecomputedLinear
from leantune.checkpointing import (FullCheckpointing, SelectiveOps, apply_activation_checkpointing,
                                    inspect_checkpointing, remove_activation_checkpointing)
from leantune.flags import parse_run_config
from leantune.models.loading import attach_lora
from leantune.planning.choose import MemoryPlan
from leantune.planning.measured_choice import TIMED_STEPS, choose_by_timing
from leantune.precision import choose_precision


def _lora_model(tiny_model_dir):
    torch.manual_seed(0)
    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                        parse_run_config(["--use_peft", "--lora_dropout", "0"]).peft)
    for name, param in model.named_parameters():  # lora_B starts at zero: give it values, so its gradient shows
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model.train()


def _gradients(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_removed_checkpointing_leaves_the_model_as_it_was_and_can_be_applied_again(tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    ids = torch.randint(3, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    plain = _gradients(model, ids)
    embedding = model.get_input_embeddings()
    fresh = (len(embedding._forward_hooks), model.get_input_embeddings()(ids).requires_grad)
    apply_activation_checkpointing(model, SelectiveOps())
    lora_b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"]
    assert type(lora_b) is RecomputedLinear and inspect_checkpointing(model).enabled
    remove_activation_checkpointing(model)
    assert not inspect_checkpointing(model).enabled and type(lora_b) is torch.nn.Linear  # plain Linears again
    # and the hook transformers puts on the embeddings (their output made to require grad)
    assert (len(embedding._forward_hooks), embedding(ids).requires_grad) == fresh
    after = _gradients(model, ids)
    assert all(torch.equal(after[n], plain[n]) for n in plain)  # float32: exactly the uncheckpointed gradients
    report = apply_activation_checkpointing(model, FullCheckpointing())  # once again, not stacked
    assert report.policy.startswith("full") and report.checkpointed_layers == report.total_layers
    checkpointed = _gradients(model, ids)
    assert all(torch.equal(checkpointed[n], plain[n]) for n in plain)
    remove_activation_checkpointing(model)
    remove_activation_checkpointing(model)  # nothing left to remove: a no-op
    assert (len(embedding._forward_hooks), embedding(ids).requires_grad) == fresh  # none piled up


def _mode_of(model) -> str:
    report = inspect_checkpointing(model)
    return report.policy.split()[0] if report.enabled else "none"


class _SlowOnPurpose:
    """A fake clock and step: each step costs ``seconds_per_row[mode] x rows``, the mode read from the model."""

    def __init__(self, seconds_per_row: dict, out_of_memory: tuple = (), first_step_penalty: float = 0.0):
        self.now, self.seconds_per_row, self.out_of_memory = 0.0, seconds_per_row, out_of_memory
        self.first_step_penalty = first_step_penalty  # a candidate's first step is slower (its own warm-up)
        self.calls: list[tuple[str, int]] = []
        self.given: list[tuple[str, int]] = []  # (the model's checkpointing, the training section's batch) a step got

    def clock(self) -> float:
        return self.now

    def step_for(self, model, tc, data, precision, sharded=False, measured=True):
        assert not measured  # timed bare: a memory meter would slow the modes with more ops the most
        assert not sharded  # one process: the candidate is not sharded
        self.given.append((_mode_of(model), tc.batch_size_training))  # the candidate's checkpointing and batch

        def step(batch: int) -> int:
            mode = _mode_of(model)  # the checkpointing that runs
            self.calls.append((mode, batch))  # the tests compare it with each candidate's batch
            if mode in self.out_of_memory:
                raise torch.OutOfMemoryError("fake")
            first = all(called != mode for called, _ in self.calls[:-1])
            self.now += self.seconds_per_row[mode] * batch + (self.first_step_penalty if first else 0.0)
            return 0
        return step


@pytest.mark.parametrize("slow, chosen", [("none", "full"), ("full", "none")])
def test_auto_keeps_the_candidate_that_ran_fastest(slow, chosen, tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    cfg = parse_run_config(["--use_peft", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                            "auto", "--auto_batch_size", "--memory_budget_gb", "1"])
    plans = {"none": SimpleNamespace(name="none plan"), "full": SimpleNamespace(name="full plan")}
    memory = MemoryPlan(cfg, plans["none"], 2**30, {"none": (2, plans["none"]), "full": (4, plans["full"])})
    fake = _SlowOnPurpose({"none": 1.0, "full": 1.0, slow: 5.0})  # per row: the slow one loses whatever its batch
    lines: list[str] = []
    timed = choose_by_timing(memory, model, choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                             lines.append, step_for=fake.step_for, clock=fake.clock)
    # the warm-up at the smallest batch, then each candidate's timed steps
    assert fake.calls == [("none", 2)] + [("none", 2)] * TIMED_STEPS + [("full", 4)] * TIMED_STEPS
    assert fake.given == [("none", 2), ("full", 4)]  # each candidate's step built from its own sections
    assert (timed.cfg.checkpointing.mode or "none") == chosen and timed.plan is plans[chosen]
    assert timed.cfg.training.batch_size_training == {"none": 2, "full": 4}[chosen]
    assert inspect_checkpointing(model).enabled == (chosen == "full")  # the model trains with the winner's
    assert lines[-1].startswith(f"activation checkpointing: auto chose {chosen}, batch ")
    assert "none 2 (" in lines[-2] and "full 4 (" in lines[-2] and "tokens/s" in lines[-2]
    # one line: the choice, why, and what the model now has
    assert lines[-1].endswith(inspect_checkpointing(model).state())


def _choose(tiny_model_dir, candidates: dict, fake: "_SlowOnPurpose", first: str = "none"):
    """``choose_by_timing`` over ``candidates`` (mode -> batch), the plan's first choice being ``first``."""
    checkpointing = [] if first == "none" else ["--enable_activation_checkpointing", "--activation_checkpointing_mode",
                                                first]
    cfg = parse_run_config(["--use_peft", *checkpointing])
    plans = {mode: SimpleNamespace(mode=mode) for mode in candidates}
    memory = MemoryPlan(cfg, plans[first], 2**30, {m: (b, plans[m]) for m, b in candidates.items()})
    return choose_by_timing(memory, _lora_model(tiny_model_dir),
                            choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu")),
                            lambda _: None, step_for=fake.step_for, clock=fake.clock)


def test_auto_compares_tokens_per_second_not_step_times(tiny_model_dir):
    """full's step of 4 rows takes longer than none's of 2, but gives 25% more tokens a second."""
    timed = _choose(tiny_model_dir, {"none": 2, "full": 4}, _SlowOnPurpose({"none": 1.0, "full": 0.8}))
    assert timed.cfg.checkpointing.mode == "full"


def test_auto_keeps_each_candidates_faster_step(tiny_model_dir):
    """Each candidate's first step costs 10 s more (its own warm-up); the faster step decides, not the last or first."""
    fake = _SlowOnPurpose({"none": 1.0, "full": 0.8}, first_step_penalty=10.0)
    assert _choose(tiny_model_dir, {"none": 2, "full": 4}, fake).cfg.checkpointing.mode == "full"


def test_auto_keeps_the_plans_first_choice_unless_another_is_clearly_faster(tiny_model_dir):
    from leantune.planning.measured_choice import MARGIN

    close = _SlowOnPurpose({"none": 1.0, "full": 1.0 / (1 + MARGIN / 2)})  # full measured faster, within the margin
    assert _choose(tiny_model_dir, {"none": 2, "full": 4}, close).cfg.checkpointing.mode is None


def test_a_resumed_run_trains_with_the_saved_runs_candidate_untimed():
    from leantune.planning.measured_choice import keep_saved_choice

    cfg = parse_run_config(["--use_peft", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                            "auto", "--auto_batch_size", "--memory_budget_gb", "1"])
    plans = {"none": SimpleNamespace(), "full": SimpleNamespace()}
    memory = MemoryPlan(cfg, plans["none"], 2**30, {"none": (2, plans["none"]), "full": (4, plans["full"])})
    saved = {"config": {"batch_size_training": 4, "activation_checkpointing_mode": "full"}}
    kept = keep_saved_choice(memory, saved)
    assert kept.cfg.checkpointing.mode == "full" and kept.cfg.training.batch_size_training == 4
    assert kept.plan is plans["full"] and not kept.candidates  # nothing left to time
    other = keep_saved_choice(memory, {"config": {"batch_size_training": 3}})
    assert other.cfg is cfg and not other.candidates  # no candidate matches: the resume check names the batch
    assert keep_saved_choice(memory, None) is memory


def test_a_candidate_that_runs_out_of_memory_is_left_out_and_one_candidate_is_not_timed(tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    cfg = parse_run_config(["--use_peft", "--enable_activation_checkpointing", "--activation_checkpointing_mode",
                            "auto", "--auto_batch_size", "--memory_budget_gb", "1"])
    precision = choose_precision(cfg.model, cfg.training, cfg.peft, torch.device("cpu"))
    plan = SimpleNamespace()
    fake = _SlowOnPurpose({"none": 0.1, "full": 1.0}, out_of_memory=("none",))
    lines: list[str] = []
    memory = MemoryPlan(cfg, plan, 2**30, {"full": (2, plan), "none": (4, plan)})
    timed = choose_by_timing(memory, model, precision, lines.append, step_for=fake.step_for, clock=fake.clock)
    assert timed.cfg.checkpointing.mode == "full" and "none 4 (out of memory)" in lines[-2]
    alone = MemoryPlan(cfg, plan, 2**30, {"full": (2, plan)})
    assert choose_by_timing(alone, model, precision, lines.append, step_for=pytest.fail) is alone
