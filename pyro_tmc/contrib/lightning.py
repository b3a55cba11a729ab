"""
Data-parallel TMC training with PyTorch Lightning (``pip install pyro-tmc[distributed]``).

This module imports :mod:`lightning`; nothing else in :mod:`pyro_tmc` does, so
``import pyro_tmc`` works without it.

How it fits together
--------------------

Write the model and guide as :class:`pyro.nn.PyroModule` s (or plain
:class:`torch.nn.Module` s) whose data plate is subsampled with the *full* data
size, e.g. ``pyro.plate("data", num_data, subsample_size=len(x))``, and pass
``x``, one minibatch of one process, to both. ``TMC_ELBO()(model, guide)`` is
then an ordinary :class:`torch.nn.Module` (Pyro's ``ELBOModule``) whose
parameters are the model's and the guide's, and :class:`TMCLightningModule`
trains it like any network. Under DDP every process holds a replica of those
parameters, draws its own minibatch (Lightning's ``DistributedSampler`` gives
the processes disjoint shards of each epoch) and its own particles (the Pyro
seed is offset by the rank), and DDP averages the gradients before each step.

Why the averaged gradient is right
----------------------------------

``TMC_ELBO`` multiplies each subsampled plate's product by ``N / B`` (full
size over subsample size), so one process's loss ``L_r`` estimates the
full-data loss. DDP steps along ``g = (1/R) sum_r grad L_r``, an average of R
independent draws of the same estimator, so ``E[g] = E[grad L_r]``: the
gradient of single-process training with the same per-process batch size B,
with R times less variance. Two cases:

- Latents only inside the data plate (a VAE, with global *parameters*):
  ``L_r = -(N/B) sum_{i in batch_r} log P_TMC,i`` is a sum over data points, so
  ``E[g]`` is also the full-batch gradient, and for the same particles ``g``
  equals the gradient of one process with batch R * B exactly.
  ``tests/contrib/test_distributed.py`` checks the expectation statistically.
- A latent outside the data plate (global, drawn K times): ``log P_TMC`` is a
  ``log sum_k exp((N/B) ...)`` over the global particles, not a sum over data
  points, so the subsampled loss, distributed or not, is not an unbiased
  estimate of the full-batch one. DDP changes nothing there: ``E[g]`` is still
  the single-process gradient at batch size B.

The data must be split by the sampler, not by ``pyro.plate`` itself: a plate
that draws its own subsample picks indices from the same Pyro seed family
everywhere and does not shard the data between processes.

Pyro parameters must be module parameters, or DDP never sees them: use
``pyro.settings.set(module_local_params=True)`` with ``PyroModule`` /
``PyroParam`` (or ``nn.Module`` submodules); :func:`check_parameters_registered`
raises when a ``pyro.param`` lives only in Pyro's global param store. Lazily
created parameters (autoguides, ``PyroParam`` s) need one call of the loss on
a minibatch before training; :func:`fit_data_parallel` does it.

Example::

    pyro.settings.set(module_local_params=True)
    result = fit_data_parallel(vae.model, vae.guide, TMC_ELBO(num_samples=8, max_plate_nesting=1),
                               dataset, devices=2, batch_size=64, max_epochs=1,
                               step_kwargs={"num_data": len(dataset)})
    result.samples_per_second, result.history[-1]["train_loss"]
"""

import csv
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

import pyro
from pyro.infer.elbo import ELBO, ELBOModule

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as error:  # pragma: no cover - exercised without lightning only
    raise ImportError(
        "pyro_tmc.contrib.lightning needs PyTorch Lightning: pip install 'pyro-tmc[distributed]' "
        "(or pip install lightning)"
    ) from error

__all__ = [
    "DataParallelFit",
    "TMCLightningModule",
    "build_trainer",
    "check_parameters_registered",
    "fit_data_parallel",
]


def _as_args(batch) -> tuple:
    """A DataLoader batch as positional arguments of the model and guide."""
    return tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)


def _batch_size(batch) -> int:
    return len(_as_args(batch)[0])


def check_parameters_registered(loss_module: torch.nn.Module) -> None:
    """
    Raise if a parameter in Pyro's global param store is not a parameter of
    ``loss_module``: DDP would neither synchronise nor (with a torch optimizer
    over the module's parameters) train it.

    :param loss_module: usually ``elbo(model, guide)``, after one call.
    :raises ValueError: naming the unregistered parameters.
    """
    registered = {id(p) for p in loss_module.parameters()}
    store = pyro.get_param_store()
    missing = [name for name in store if id(store[name].unconstrained()) not in registered]
    if missing:
        raise ValueError(
            f"Pyro parameters {missing} are in Pyro's global param store but are not parameters "
            "of the model or guide module, so data-parallel training would not synchronise them. "
            "Call pyro.settings.set(module_local_params=True) and declare them as PyroParam / "
            "nn.Parameter attributes of a PyroModule (or nn.Module submodules), and "
            "pyro.clear_param_store()."
        )


class TMCLightningModule(pl.LightningModule):
    """
    A Lightning module that minimises a Pyro loss (``TMC_ELBO`` or any Pyro ELBO)
    for a model and guide that are :class:`torch.nn.Module` s.

    Each DataLoader batch ``(x, ...)`` is passed as ``model(x, ..., **step_kwargs)``
    and ``guide(x, ..., **step_kwargs)``.

    :param model: the model, a :class:`torch.nn.Module` (e.g. a ``PyroModule``).
    :param guide: the guide, a :class:`torch.nn.Module`.
    :param loss: a Pyro :class:`~pyro.infer.elbo.ELBO` instance, e.g. ``TMC_ELBO(num_samples=8)``.
    :param optimizer: a :class:`torch.optim.Optimizer` class.
    :param dict optimizer_kwargs: its keyword arguments (default ``{"lr": 1e-3}``).
    :param dict step_kwargs: keyword arguments of every model and guide call,
        e.g. ``{"num_data": len(dataset)}`` for the plate's full size.
    :param float loss_normaliser: the logged ``train_loss`` is the loss divided by
        this (e.g. the data size, to log nats per data point); the optimised loss is not.
    :param int seed: if given, each process seeds Pyro with ``seed + global_rank``
        when training starts, so that processes draw different particles.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        guide: torch.nn.Module,
        loss: ELBO,
        optimizer=torch.optim.Adam,
        optimizer_kwargs: Optional[dict[str, Any]] = None,
        step_kwargs: Optional[dict[str, Any]] = None,
        loss_normaliser: float = 1.0,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not isinstance(loss, ELBO):
            raise ValueError(f"loss must be a pyro.infer.ELBO instance such as TMC_ELBO(), got {loss!r}")
        for name, module in (("model", model), ("guide", guide)):
            if not isinstance(module, torch.nn.Module):
                raise ValueError(
                    f"the {name} must be a torch.nn.Module (e.g. a pyro.nn.PyroModule) so that its "
                    f"parameters are module parameters; got {type(module).__name__}"
                )
        self.elbo: ELBOModule = loss(model, guide)
        self.optimizer_class = optimizer
        self.optimizer_kwargs = {"lr": 1e-3} if optimizer_kwargs is None else dict(optimizer_kwargs)
        self.step_kwargs = {} if step_kwargs is None else dict(step_kwargs)
        self.loss_normaliser = float(loss_normaliser)
        self.seed = seed

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The differentiable loss of one minibatch."""
        return self.elbo(*args, **{**self.step_kwargs, **kwargs})

    def initialize(self, batch) -> torch.Tensor:
        """Run the loss once without gradients, creating lazy parameters; then check them."""
        params = list(self.parameters())
        args = _as_args(batch)
        if params:
            args = tuple(a.to(params[0].device) if torch.is_tensor(a) else a for a in args)
        with torch.no_grad():
            loss = self(*args)
        check_parameters_registered(self.elbo)
        return loss

    def on_train_start(self) -> None:
        if self.seed is not None:
            pyro.set_rng_seed(self.seed + self.global_rank)

    def training_step(self, batch, batch_idx):
        loss = self(*_as_args(batch))
        # sync_dist: the logged value is the average over processes, the loss DDP descends.
        self.log(
            "train_loss",
            loss.detach() / self.loss_normaliser,
            on_step=True,
            on_epoch=False,
            sync_dist=True,
            batch_size=_batch_size(batch),
        )
        return loss

    def configure_optimizers(self):
        return self.optimizer_class(self.elbo.parameters(), **self.optimizer_kwargs)


class _Throughput(pl.Callback):
    """Logs ``samples_per_s``: samples of all processes per second, between consecutive step ends."""

    def __init__(self) -> None:
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None:
            rate = _batch_size(batch) * trainer.world_size / (now - self._last)
            pl_module.log(
                "samples_per_s",
                rate,
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
                batch_size=_batch_size(batch),
            )
        self._last = now


def _default_strategy(accelerator: str, devices: int):
    if devices == 1:
        return "auto"
    if accelerator == "cpu":
        # Fork: fast to start, works in scripts, notebooks and pytest alike.
        start = "fork" if sys.platform != "win32" else "spawn"
        return DDPStrategy(start_method=start, process_group_backend="gloo")
    # CUDA cannot be forked once initialised: re-launch the script, except in notebooks.
    interactive = (
        hasattr(sys, "ps1") or bool(getattr(sys.flags, "interactive", 0)) or "ipykernel" in sys.modules
    )
    return "ddp_notebook" if interactive else "ddp"


def build_trainer(
    devices: int = 1,
    accelerator: str = "cpu",
    strategy=None,
    max_epochs: int = 1,
    max_steps: int = -1,
    log_dir: Optional[str] = None,
    **trainer_kwargs,
) -> "pl.Trainer":
    """
    A :class:`lightning.pytorch.Trainer` for ``devices`` CPU processes (gloo) or GPUs (nccl).

    :param int devices: processes (CPU) or GPUs; above 1, DDP.
    :param str accelerator: ``"cpu"``, ``"gpu"``/``"cuda"`` or ``"auto"``.
    :param strategy: a Lightning strategy; default: single device for 1, else DDP
        started by fork on CPU, and on GPU by re-launching the script (``"ddp"``),
        or by fork in a notebook (``"ddp_notebook"``: CUDA must not be initialised
        before ``fit`` then).
    :param str log_dir: where the CSV log goes (default: a new temporary folder).
    :param trainer_kwargs: passed to the Trainer (they override the quiet defaults:
        no progress bar, summary or checkpoints, a log row every step; ``callbacks``
        are added to the one that logs ``samples_per_s``).
    """
    devices = int(devices)
    if devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices}")
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"accelerator must be 'cpu', 'gpu', 'cuda' or 'auto', got {accelerator!r}")
    if strategy is None:
        strategy = _default_strategy(accelerator, devices)
    log_dir = tempfile.mkdtemp(prefix="pyro_tmc_") if log_dir is None else log_dir
    options = dict(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_epochs=max_epochs,
        max_steps=max_steps,
        logger=CSVLogger(log_dir, name="", version=""),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    options.update(trainer_kwargs)
    options["callbacks"] = [_Throughput()] + list(trainer_kwargs.get("callbacks") or [])
    return pl.Trainer(**options)


@dataclass
class DataParallelFit:
    """What :func:`fit_data_parallel` returns."""

    module: TMCLightningModule  #: the trained module (in this process, with rank 0's parameters)
    trainer: "pl.Trainer"
    history: list[dict[str, float]] = field(default_factory=list)  #: per-step rows of the CSV log
    samples_per_second: float = math.nan  #: median over steps after the first ``warmup_steps``
    wall_seconds: float = math.nan  #: the whole ``fit`` call, process start-up included


def _read_history(log_dir: str) -> list[dict[str, float]]:
    path = os.path.join(log_dir, "metrics.csv")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            rows.append({key: float(value) for key, value in row.items() if value not in ("", None)})
    merged: dict[int, dict[str, float]] = {}
    for row in rows:
        merged.setdefault(int(row.get("step", -1)), {}).update(row)
    return [merged[step] for step in sorted(merged)]


def fit_data_parallel(
    model: torch.nn.Module,
    guide: torch.nn.Module,
    loss: ELBO,
    dataset: torch.utils.data.Dataset,
    devices: int = 1,
    *,
    batch_size: int = 128,
    max_epochs: int = 1,
    max_steps: int = -1,
    accelerator: str = "cpu",
    strategy=None,
    optimizer=torch.optim.Adam,
    optimizer_kwargs: Optional[dict[str, Any]] = None,
    step_kwargs: Optional[dict[str, Any]] = None,
    loss_normaliser: float = 1.0,
    seed: int = 0,
    warmup_steps: int = 2,
    log_dir: Optional[str] = None,
    **trainer_kwargs,
) -> DataParallelFit:
    """
    Train ``model`` and ``guide`` on ``dataset`` by minimising ``loss`` with
    data-parallel SGD over ``devices`` processes.

    Each process takes minibatches of ``batch_size`` from its own shard of
    ``dataset`` (shuffled every epoch; the last partial batch is dropped so the
    plate's subsample size is constant), calls ``model(*batch, **step_kwargs)``,
    and DDP averages the gradients (see the module docstring for why that is
    the single-process gradient in expectation). Pass the full data size, e.g.
    ``step_kwargs={"num_data": len(dataset)}``, for the model's subsampled plate.

    :param model: a :class:`torch.nn.Module` model (e.g. a ``PyroModule``).
    :param guide: a :class:`torch.nn.Module` guide.
    :param loss: a Pyro ELBO, e.g. ``TMC_ELBO(num_samples=8, max_plate_nesting=1)``.
    :param dataset: a map-style dataset yielding tensors or tuples of tensors.
    :param int devices: processes (CPU) or GPUs.
    :param int batch_size: per process; a step sees ``devices * batch_size`` data points.
    :param str accelerator: ``"cpu"``, ``"gpu"`` or ``"auto"``.
    :param int seed: seeds Pyro before the call that creates lazy parameters
        (DDP then broadcasts rank 0's parameters to every process) and, offset
        by the rank, each process's particles.
    :param int warmup_steps: steps left out of ``samples_per_second``.
    :param trainer_kwargs: passed to :func:`build_trainer` and the Trainer.
    :returns: a :class:`DataParallelFit`.
    """
    pyro.set_rng_seed(seed)
    module = TMCLightningModule(
        model, guide, loss, optimizer, optimizer_kwargs, step_kwargs, loss_normaliser, seed
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True)
    # Lazy parameters must exist before DDP wraps the module and the optimizer is built.
    # Initialise on the CPU: a forked GPU process needs CUDA uninitialised here.
    module.initialize(next(iter(loader)))
    log_dir = tempfile.mkdtemp(prefix="pyro_tmc_") if log_dir is None else log_dir
    trainer = build_trainer(devices, accelerator, strategy, max_epochs, max_steps, log_dir, **trainer_kwargs)
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    wall = time.perf_counter() - start
    history = _read_history(log_dir)
    rates = [row["samples_per_s"] for row in history[warmup_steps:] if "samples_per_s" in row]
    rate = float(torch.tensor(rates).median()) if rates else math.nan
    return DataParallelFit(module, trainer, history, rate, wall)
