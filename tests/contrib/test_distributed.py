"""Data-parallel TMC training: the DDP-averaged gradient against the full-batch one
(statistically, in one process), and 2 CPU processes (gloo) under Lightning."""

import math

import pytest
import torch
from torch import nn

import pyro
import pyro.distributions as dist
from pyro.nn import PyroModule

from pyro_tmc import TMC_ELBO


@pytest.fixture(autouse=True)
def module_local_params():
    pyro.clear_param_store()
    with pyro.settings.context(module_local_params=True):
        yield
    pyro.clear_param_store()


class LinearModel(PyroModule):
    """z_i ~ N(0, I), x_i ~ N(W z_i + b, I), in a data plate of full size ``num_data``."""

    def __init__(self, z_dim=2, x_dim=3):
        super().__init__()
        self.z_dim = z_dim
        self.decoder = nn.Linear(z_dim, x_dim)

    def forward(self, x, num_data=None):
        with pyro.plate("data", num_data or len(x), subsample_size=len(x)):
            z = pyro.sample("z", dist.Normal(x.new_zeros(self.z_dim), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(self.decoder(z), 1.0).to_event(1), obs=x)


class LinearGuide(PyroModule):
    """q(z_i | x_i) = N(A x_i + c, diag(exp(D x_i + e)))."""

    def __init__(self, z_dim=2, x_dim=3):
        super().__init__()
        self.encoder = nn.Linear(x_dim, 2 * z_dim)

    def forward(self, x, num_data=None):
        loc, log_scale = self.encoder(x).chunk(2, -1)
        with pyro.plate("data", num_data or len(x), subsample_size=len(x)):
            pyro.sample("z", dist.Normal(loc, log_scale.exp()).to_event(1))


def _flat_grad(loss_module, x, num_data):
    params = list(loss_module.parameters())
    grads = torch.autograd.grad(loss_module(x, num_data=num_data), params)
    return torch.cat([g.reshape(-1) for g in grads])


def test_ddp_average_gradient_is_full_batch_gradient_in_expectation():
    """
    Two ranks take disjoint minibatches of B (as DistributedSampler does) from N
    data points; each loss is scaled by N/B at the plate, and DDP averages the
    two gradients. For latents local to the data plate that average is, in
    expectation over minibatches and particles, the full-batch TMC gradient.
    """
    pyro.set_rng_seed(0)
    num_data, batch, ranks, reps = 8, 2, 2, 150
    data = torch.randn(num_data, 3) + torch.tensor([3.0, -2.0, 1.0])
    loss_module = TMC_ELBO(num_samples=4, max_plate_nesting=1)(LinearModel(), LinearGuide())
    ddp, full = [], []
    for _ in range(reps):
        shards = torch.randperm(num_data)[: ranks * batch].reshape(ranks, batch)
        ddp.append(sum(_flat_grad(loss_module, data[shard], num_data) for shard in shards) / ranks)
        full.append(_flat_grad(loss_module, data, num_data))
    ddp, full = torch.stack(ddp), torch.stack(full)
    se = (ddp.var(0) / reps + full.var(0) / reps).sqrt()
    z = (ddp.mean(0) - full.mean(0)) / se
    assert z.abs().max() < 4.0, z
    # The test has power: forgetting the N/B scale (plate of size B) is caught.
    unscaled = ddp.mean(0) * batch / num_data
    assert ((unscaled - full.mean(0)) / se).abs().max() > 10.0


# ---------------------------------------------------------------------------
# Two CPU processes with Lightning (gloo).
# ---------------------------------------------------------------------------


def test_two_cpu_processes_stay_synchronised_and_learn(tmp_path):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from pyro_tmc.contrib.lightning import fit_data_parallel

    class SaveRank(pl.Callback):
        """Each rank writes its final parameters and its own (unsynchronised) losses."""

        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module):
            state = {k: v.detach().cpu().clone() for k, v in pl_module.elbo.state_dict().items()}
            torch.save({"state": state, "losses": self.losses}, tmp_path / f"rank{trainer.global_rank}.pt")

    pyro.set_rng_seed(0)
    data = torch.randn(1024, 3) + torch.tensor([3.0, -2.0, 1.0])
    dataset = torch.utils.data.TensorDataset(data)
    result = fit_data_parallel(
        LinearModel(),
        LinearGuide(),
        TMC_ELBO(num_samples=4, max_plate_nesting=1),
        dataset,
        devices=2,
        batch_size=32,
        max_epochs=2,
        optimizer_kwargs={"lr": 0.05},
        step_kwargs={"num_data": len(dataset)},
        loss_normaliser=len(dataset),
        log_dir=str(tmp_path / "logs"),
        callbacks=[SaveRank()],
    )
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")
    assert rank0["state"].keys() == rank1["state"].keys()
    for name in rank0["state"]:
        assert torch.equal(rank0["state"][name], rank1["state"][name]), name
    # The ranks saw different minibatches and particles: the agreement is DDP's doing.
    assert rank0["losses"] != rank1["losses"]
    # The process that called fit holds rank 0's trained parameters.
    for name, value in result.module.elbo.state_dict().items():
        assert torch.equal(value, rank0["state"][name]), name
    # 2 epochs of 1024 / (2 * 32) = 16 steps each.
    losses = [row["train_loss"] for row in result.history if "train_loss" in row]
    assert len(losses) == 32
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert result.samples_per_second > 0


def test_parameters_outside_the_modules_are_refused():
    pytest.importorskip("lightning")
    from pyro_tmc.contrib.lightning import TMCLightningModule

    class GlobalParamGuide(PyroModule):
        def forward(self, x, num_data=None):
            loc = pyro.param("global_loc", lambda: torch.zeros(2))
            with pyro.plate("data", num_data or len(x), subsample_size=len(x)):
                pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))

    loss = TMC_ELBO(num_samples=2, max_plate_nesting=1)
    x = torch.randn(4, 3)
    with pyro.settings.context(module_local_params=False):
        module = TMCLightningModule(LinearModel(), GlobalParamGuide(), loss)
        with pytest.raises(ValueError, match="global_loc"):
            module.initialize((x,))
    with pytest.raises(ValueError, match="torch.nn.Module"):
        TMCLightningModule(lambda x: None, LinearGuide(), loss)
