"""A captured step times its first steps phase by phase (pyro_tmc.compile.phase_times)."""

import time

import pytest
import torch

import pyro

from pyro_tmc import TMC_ELBO
from pyro_tmc.compile.phase_times import (
    COMPILE,
    EAGER,
    PLAN_ROLLING,
    ROLL_STEP,
    TRACE_BACKWARD,
    TRACE_FORWARD,
    PhaseTimes,
    timed,
)
from tests.common.compile_cases import chain_guide, chain_model, toy_guide, toy_model


def test_phases_sum_where_they_run_twice():
    times = PhaseTimes()
    for _ in range(2):
        with times.phase("a"):
            time.sleep(0.01)
    with timed(None, "b"):  # not timed
        pass
    assert set(times.seconds) == {"a"} and times.seconds["a"] >= 0.02
    assert times.total() == pytest.approx(times.seconds["a"])


@pytest.mark.parametrize("rolled", [False, True], ids=["short", "rolled"])
def test_a_capture_records_its_phases_and_its_first_replay(rolled):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=0 if rolled else 1, compile="graph")
    model, guide, args = (
        (chain_model, chain_guide, (torch.tensor(0.5), 60))
        if rolled
        else (toy_model, toy_guide, (torch.randn(6),))
    )
    assert loss.step_program is not None and loss.step_program.phase_seconds() == {}
    loss.loss_and_grads(model, guide, *args)  # eager
    loss.loss_and_grads(model, guide, *args)  # captured
    phases = loss.step_program.phase_seconds()
    expected = {EAGER, TRACE_FORWARD, TRACE_BACKWARD} | ({PLAN_ROLLING, ROLL_STEP} if rolled else set())
    assert set(phases) == expected and all(seconds > 0 for seconds in phases.values())
    loss.loss_and_grads(model, guide, *args)  # the first replay
    loss.loss_and_grads(model, guide, *args)  # a later one adds nothing
    assert set(loss.step_program.phase_seconds()) == expected | {COMPILE}
