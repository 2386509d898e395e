"""The decode attention launch sweep (inference_node/tuner/attention_trials.py) on the CPU: its
logic with fake timers (the reference takes no launch here), and what it writes into a table."""
from __future__ import annotations

import pytest
import torch

from inference_node.tuner import attention_trials
from inference_node.tuner.attention_trials import RULE, AttentionMeasured, launches_for
from inference_node.tuner.sweep import Budget
from inference_node.tuner.tune import tune_table
from kernels.tuning import DEFAULT_TUNING
from kernels.tuning_table import ModelShape, TuningTable

TINY = ModelShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)
WINNER = (2048, 2, 3)


class LaunchTimer:
    """Microseconds by the launch timed: `fast` takes `fast_us`, every other 100; each call
    moves a fake clock on by `cost_s`."""

    def __init__(self, fast=WINNER, fast_us: float = 50.0, cost_s: float = 1.0) -> None:
        self.fast, self.fast_us, self.cost_s, self.now = fast, fast_us, cost_s, 0.0
        self.timed: list = []

    def clock(self) -> float:
        return self.now

    def __call__(self, calls_for, copies) -> float:
        self.now += self.cost_s
        calls_for(copies[0])()
        self.timed.append(calls_for.launch)
        return self.fast_us if calls_for.launch == self.fast else 100.0


def sweep(timer: LaunchTimer, budget_s: float = 60.0):
    budget = Budget(budget_s, "test", clock=timer.clock)
    return attention_trials.sweep(TINY, torch.device("cpu"), torch.float32, timer, budget), budget


def test_the_fastest_checked_launch_becomes_the_batchs_entry() -> None:
    """The rule's launch is timed first, then every candidate at both contexts; the one
    fastest by more than the gain threshold becomes the batch's entry."""
    timer = LaunchTimer()
    (results, skipped), budget = sweep(timer)
    assert skipped == [] and len(results) == 1
    measured = results[0]
    assert timer.timed[0] is None and WINNER in timer.timed
    assert measured.best == WINNER and measured.best_us == 2 * 50.0 and measured.default_us == 2 * 100.0
    assert measured.timed == len(attention_trials.candidates(TINY.head_dim)) == budget.total
    assert launches_for(results) == {str(measured.batch): WINNER}


def test_no_entries_where_the_rule_wins_or_gains_too_little() -> None:
    """A table keeps the rule's launch where no candidate beats it by MIN_GAIN; where some
    batch has a winner, the others get the rule's launch written out (a smaller batch's
    entry must not serve them)."""
    assert launches_for(sweep(LaunchTimer(fast=None))[0][0]) == {}
    assert launches_for(sweep(LaunchTimer(fast_us=99.5))[0][0]) == {}
    results = [AttentionMeasured(8, 100.0, WINNER, 99.0, 5), AttentionMeasured(64, 100.0, None, 100.0, 5),
               AttentionMeasured(256, 100.0, WINNER, 80.0, 5)]
    assert launches_for(results) == {"8": RULE, "64": RULE, "256": WINNER}


def test_a_launch_that_answers_wrong_is_rejected(monkeypatch) -> None:
    """A candidate whose output does not match the reference is refused, named with its error;
    the rule's launch failing its check is an error of the sweep."""
    real = attention_trials.attention_call

    def wrong_for_winner(case, launch):
        calls_for = real(case, launch)
        if launch != WINNER:
            return calls_for

        def broken(cache):
            run = calls_for(cache)
            return lambda: (run(), case.out.mul_(2.0))
        broken.launch = launch
        return broken

    monkeypatch.setattr(attention_trials, "attention_call", wrong_for_winner)
    (results, _), _ = sweep(LaunchTimer())
    assert results[0].best != WINNER
    assert any(why.startswith("2048.2.3: relative error") for why in results[0].rejected)
    monkeypatch.setattr(attention_trials, "attention_call", lambda case, launch: wrong_for_winner(case, WINNER))
    with pytest.raises(ValueError, match="relative error"):
        sweep(LaunchTimer())


def test_a_spent_budget_leaves_the_batch_unmeasured() -> None:
    (results, skipped), _ = sweep(LaunchTimer(), budget_s=0.0)
    assert results == [] and skipped == [attention_trials.BATCHES[0]]
    (results, skipped), _ = sweep(LaunchTimer(cost_s=10.0), budget_s=25.0)  # two contexts each: the rule, a rival
    assert skipped == [] and results[0].timed == 2


def test_the_table_holds_the_launches_node_wide_and_keeps_other_batches_entries(monkeypatch) -> None:
    """tune_table files the sweep's entries as the node-wide attention_decode_launches, over
    an existing table's entries for batches it did not measure; every step's Tuning reads
    them back."""
    measured = [AttentionMeasured(64, 100.0, None, 100.0, 5), AttentionMeasured(256, 100.0, WINNER, 80.0, 5)]
    monkeypatch.setattr(attention_trials, "sweep", lambda *args, **kwargs: (measured, []))
    node = {"attention_decode_launches": {"8": (8192, 2, 1), "64": (4096, 8, 3)}}
    existing = TuningTable("cpu", TINY, "float32", node, ())
    table, results = tune_table(TINY, torch.device("cpu"), torch.float32, budget_s=30, batches=(4,),
                                adapters=(0,), groups=("qkv", "attention"), existing=existing, max_candidates=1)
    assert dict(table.node["attention_decode_launches"]) == {"8": (8192, 2, 1), "64": RULE, "256": WINNER}
    assert set(measured) <= set(results)
    steps = table.tunings(DEFAULT_TUNING)
    assert steps.for_step(200, 0).attention_decode_launch(200) == WINNER
    assert steps.for_step(4, 0).attention_decode_launch(4) == (8192, 2, 1)


def test_no_memory_for_the_kv_copies_leaves_the_batch_unmeasured(monkeypatch, caplog) -> None:
    """A GPU without room for a batch's KV copies (a small card at the node's first start)
    leaves that batch unmeasured and says so; the sweep, and the GEMMs' table, go on."""
    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(attention_trials, "KvCase", no_memory)
    (results, skipped), _ = sweep(LaunchTimer())
    assert results == [] and skipped == [attention_trials.BATCHES[0]]
    assert "no memory for its KV copies" in caplog.text
