"""The models, guides and cases that the capture tests (tests/compile) share, and the comparison of
a replayed step with the eager step on the same draw."""

import math
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer.autoguide import AutoNormal

from tests.common import pyro_style_models as M

# -- models with learnable guides ------------------------------------------------


def toy_model(x):
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def toy_guide(x):
    loc = pyro.param("loc", lambda: x.new_tensor([0.3, -0.2]))
    log_scale = pyro.param("log_scale", lambda: x.new_tensor([0.1, 0.4]))
    pyro.sample("theta", dist.Normal(loc[0], log_scale[0].exp()))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("z", dist.Normal(loc[1], log_scale[1].exp()))


def chain_model(x, N):
    z = x.new_zeros(())
    for i in pyro.markov(range(1, N + 1)):
        z = pyro.sample(f"z_{i}", dist.Normal(z, math.sqrt(1.0 / N)))
    pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def chain_guide(x, N):
    loc = pyro.param("chain_loc", lambda: 0.1 * torch.arange(N, dtype=x.dtype))
    log_scale = pyro.param("chain_log_scale", lambda: -0.5 * torch.ones(N, dtype=x.dtype))
    for i in pyro.markov(range(1, N + 1)):
        pyro.sample(f"z_{i}", dist.Normal(loc[i - 1], log_scale[i - 1].exp()))


def nonfactorised_guide(x):
    """z depends on theta's particles: a mixture proposal over theta's particles."""
    scale = pyro.param("nf_scale", lambda: x.new_tensor(0.8), constraint=dist.constraints.positive)
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), scale))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("z", dist.Normal(0.5 * theta, 1.2))


def masked_subsampled_model(x):
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    mask = torch.arange(x.shape[-1]) % 3 != 0
    with pyro.plate("data", 20, subsample=torch.arange(x.shape[-1]), dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        with poutine.mask(mask=mask):
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def lognormal_model(x):
    sigma = pyro.sample("sigma", dist.LogNormal(0.0, 0.5))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("x", dist.Normal(0.0, sigma), obs=x)


def hmm_case():
    pyro.set_rng_seed(3)
    data = torch.randint(4, (3, 9))
    guide = M.globals_guide(M.categorical_hmm, {"init", "trans", "emit"})
    return M.categorical_hmm, guide, (data,), 1


def cases():
    """Each case's name: (model, guide, args, max_plate_nesting)."""
    x = torch.randn(6)
    return {
        "toy": (toy_model, toy_guide, (x,), 1),
        "chain_log_depth": (chain_model, chain_guide, (torch.tensor(0.7), 12), 0),
        "non_factorised": (toy_model, nonfactorised_guide, (x,), 1),
        "mask_and_subsample": (masked_subsampled_model, toy_guide, (x,), 1),
        "autonormal": (lognormal_model, AutoNormal(lognormal_model), (x,), 1),
        "hmm_autodelta": hmm_case(),
    }


# -- a custom backward -------------------------------------------------------------


class DoubleGrad(torch.autograd.Function):
    """The identity, whose backward doubles the gradient: a custom autograd.Function."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


# -- a replayed step against the eager step ---------------------------------------------


def params_by_name():
    store = pyro.get_param_store()
    return {name: store.get_param(name).unconstrained() for name in store}


def one_step(step, params):
    """``step()``'s loss and the gradient it leaves in each parameter's ``.grad``."""
    for p in params.values():
        p.grad = None
    loss = step()
    return loss, {name: None if p.grad is None else p.grad.clone() for name, p in params.items()}


def replay_and_eager(make_loss, model, guide, args, mode="graph", **loss_kwargs):
    """The same draw through a replayed step and through the eager step."""
    loss = make_loss(compile=mode, **loss_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        for _ in range(2):  # eager, then captured
            loss.loss_and_grads(model, guide, *args)
        params = params_by_name()
        state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        replayed = one_step(lambda: loss.loss_and_grads(model, guide, *args), params)
    assert loss.step_program.captures == 1 and loss.step_program.replays == 1
    torch.set_rng_state(state)
    if cuda_state is not None:
        torch.cuda.set_rng_state_all(cuda_state)
    eager = one_step(lambda: loss._eager_loss_and_grads(model, guide, args, {}), params)
    return replayed, eager


def assert_same_step(replayed, eager, rtol=1e-5):
    (value_r, grads_r), (value_e, grads_e) = replayed, eager
    assert value_r == pytest.approx(value_e, rel=rtol, abs=rtol)
    assert grads_r.keys() == grads_e.keys()
    for name, grad in grads_e.items():
        other = grads_r[name]
        if grad is None or other is None:  # a parameter this loss does not read
            assert grad is None or not grad.abs().any()
            continue
        assert torch.allclose(other, grad, rtol=rtol, atol=rtol * max(1.0, grad.abs().max().item())), name
