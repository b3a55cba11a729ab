"""Hand broadcasting of a latent's particles is caught under validation (the probe draw)."""

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc import TMC_ELBO

N = 12
FEATURES = torch.linspace(-1.0, 1.0, N * 3).reshape(N, 3)
TARGETS = FEATURES @ torch.tensor([1.0, -2.0, 0.5]) + 0.3


def _regression(idiom, calls):
    def model():
        calls.append("model")
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", N):
            if idiom == "unsqueeze":
                mean = (FEATURES * w.unsqueeze(-2)).sum(-1)
            elif idiom == "einsum":
                mean = torch.einsum("...d,nd->...n", w, FEATURES)
            elif idiom == "matmul":
                mean = (FEATURES @ w[..., None]).squeeze(-1)
            else:  # the idiom that broadcasts over particle dims
                mean = (FEATURES * w).sum(-1)
            pyro.sample("y", dist.Normal(mean + b, 0.5), obs=TARGETS)

    return model


def _guide():
    pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    pyro.sample("b", dist.Normal(0.0, 1.0))


@pytest.fixture
def validation():
    yield pyro.enable_validation(True)
    pyro.enable_validation(True)


@pytest.mark.parametrize("idiom", ["unsqueeze", "einsum", "matmul"])
def test_hand_broadcasting_raises_under_validation(idiom, validation):
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    with pytest.raises(ValueError, match="broadcast by hand") as raised:
        elbo.loss(_regression(idiom, []), _guide)
    message = str(raised.value)
    assert "after sample site 'b'" in message and "(X * w).sum(-1)" in message


@pytest.mark.parametrize("idiom", ["unsqueeze", "einsum", "matmul"])
def test_hand_broadcasting_is_silent_without_validation(idiom):
    """What the probe guards against: equal counts hide the mistake (and the check costs nothing)."""
    pyro.enable_validation(False)
    try:
        calls = []
        TMC_ELBO(num_samples=8, max_plate_nesting=1).loss(_regression(idiom, calls), _guide)
    finally:
        pyro.enable_validation(True)
    assert calls == ["model"]  # no probe draw


def test_probe_runs_once_per_loss_and_passes_a_correct_model(validation):
    calls = []
    elbo = TMC_ELBO(num_samples=8, max_plate_nesting=1)
    for _ in range(3):
        elbo.loss(_regression("right", calls), _guide)
    assert calls == ["model"] * 4  # three draws and one probe


def test_probe_leaves_the_random_stream_alone(validation):
    values = []
    for validate in (True, False):
        pyro.enable_validation(validate)
        pyro.set_rng_seed(3)
        loss = TMC_ELBO(num_samples=8, max_plate_nesting=1).loss(_regression("right", []), _guide)
        values.append((loss, torch.rand(()).item()))
    assert values[0] == values[1]


def test_site_varying_along_another_latents_dim_is_named(validation):
    """No broadcasting error: the moved particles land on a dim whose latent then has another size."""

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        # w's particles (dim -2) moved onto b's dim (-3), where b is size 1 after .mean(-3)
        moved = w.unsqueeze(-2) + b.mean(-3, keepdim=True)
        with pyro.plate("data", 2):
            pyro.sample("y", dist.Normal(moved, 1.0), obs=torch.zeros(2))

    def guide():
        pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    with pytest.raises(
        ValueError, match="Site 'y' varies along the particle dim of latent 'b'.*count of \\['w'\\]"
    ):
        TMC_ELBO(num_samples=4, max_plate_nesting=1).loss(model, guide)
