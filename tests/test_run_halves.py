"""The greenlet scheduler of the interleaved halves (megatron_boost/parallel/interleave.py):
the order it runs the halves in, what each half sees of torch's per-thread grad mode and of
context variables, and what an error in one half does.

Negative controls: a hand-over that does not switch runs the halves one after the other, and
one that does not restore grad mode lets a half inside a no-grad region (a custom autograd
Function's forward) switch grad off for the other; both fail the tests below.
"""

from __future__ import annotations

import contextvars

import pytest
import torch

from megatron_boost.parallel import interleave
from megatron_boost.parallel.interleave import hand_over, in_half, run_halves

pytestmark = pytest.mark.fast


def _steps(log, name, n):
    for i in range(n):
        log.append(f"{name}{i}")
        hand_over()
    log.append(f"{name}-done")
    return name


def test_the_halves_alternate_at_each_hand_over_and_return_in_order():
    log = []
    results = run_halves(lambda name: _steps(log, name, 3 if name == "a" else 1), ["a", "b"])
    assert results == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b-done", "a2", "a-done"]


def test_outside_the_halves_a_hand_over_does_nothing():
    assert not in_half()
    hand_over()
    assert run_halves(lambda x: in_half(), [0, 1]) == [True, True]


def test_each_half_keeps_its_own_grad_mode_across_hand_overs():
    seen = {}

    def half(name):
        if name == "a":
            with torch.no_grad():  # as inside a custom Function's forward
                hand_over()
                seen["a, resumed"] = torch.is_grad_enabled()
        else:
            seen["b, while a is in no_grad"] = torch.is_grad_enabled()
            hand_over()
        return name

    with torch.enable_grad():
        run_halves(half, ["a", "b"])
        assert torch.is_grad_enabled()
    assert seen == {"b, while a is in no_grad": True, "a, resumed": False}


def test_each_half_sees_the_callers_context_variables_and_keeps_its_own_changes():
    var = contextvars.ContextVar("var", default="unset")
    var.set("caller")

    def half(name):
        before = var.get()
        var.set(name)
        hand_over()
        return before, var.get()

    assert run_halves(half, ["a", "b"]) == [("caller", "a"), ("caller", "b")]
    assert var.get() == "caller"


def test_an_error_in_one_half_reaches_the_caller_and_unwinds_the_other():
    unwound = []

    def half(name):
        try:
            hand_over()
            if name == "b":
                raise ValueError("half b failed")
            hand_over()
        finally:
            unwound.append(name)
        return name

    with pytest.raises(ValueError, match="half b failed"):
        run_halves(half, ["a", "b"])
    assert sorted(unwound) == ["a", "b"]


def test_negative_control_without_the_switch_the_halves_run_in_turn(monkeypatch):
    monkeypatch.setattr(interleave, "hand_over", lambda: None)
    log = []

    def half(name):
        log.append(name)
        interleave.hand_over()
        log.append(name)

    run_halves(half, ["a", "b"])
    assert log == ["a", "a", "b", "b"]
