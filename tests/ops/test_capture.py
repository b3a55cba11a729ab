"""The capture context (:mod:`pyro_tmc.ops.capture`): one object, entered in one place."""

import threading

import pytest
import torch

from pyro_tmc.ops.capture import (
    CaptureContext,
    capturing,
    counting_repairs,
    current,
    deferred_underflow_checks,
    is_tracing,
)
from pyro_tmc.ops.log_matmul import log_matmul_exp


def test_outside_any_capture_nothing_is_traced_or_recorded():
    assert current() == CaptureContext()
    assert not is_tracing() and current().underflow_flags is None


def test_capturing_replaces_only_its_fields_and_restores_them():
    with capturing(eager_estimates=True):
        with deferred_underflow_checks(repair_in_graph=True) as flags:
            assert is_tracing() and current().underflow_flags is flags
            assert current().eager_estimates  # the outer field stays
            with counting_repairs() as counts:  # inside a trace: tracing and flags stay
                assert is_tracing() and current().underflow_flags is flags
                assert current().repair_counts is counts
            assert current().repair_counts is None
        assert not is_tracing() and current().eager_estimates
    assert current() == CaptureContext()


def test_an_unknown_field_is_refused():
    with pytest.raises(TypeError), capturing(tracng=True):
        pass


def test_a_thread_sees_its_own_context():
    seen = []
    with deferred_underflow_checks():
        thread = threading.Thread(target=lambda: seen.append(is_tracing()))
        thread.start()
        thread.join()
    assert seen == [False]


def test_products_record_into_the_context_they_run_in():
    """A flag per product under a trace, a count per product while counting, nothing outside."""
    x = torch.tensor([[0.0, -200.0]])  # maxima at different summed indices: underflows in float32
    y = torch.tensor([[-200.0], [0.0]])
    with counting_repairs() as counts:
        eager = log_matmul_exp(x, y)
    assert [tuple(c.shape) for c in counts] == [(1, 1)] and counts[0].count == 0  # float64 repaired it
    with deferred_underflow_checks() as flags:
        traced = log_matmul_exp(x, y)
    assert len(flags) == 1 and bool(flags[0])  # flagged, not repaired
    assert torch.isneginf(traced).all() and torch.allclose(eager, torch.tensor([[-200.0 + 0.6931472]]))
