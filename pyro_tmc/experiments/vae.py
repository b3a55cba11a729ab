"""
The paper's MNIST experiment (Aitchison 2019, Figs. 5 and 6): a VAE with five
stochastic layers, trained with IWAE_ELBO or TMC_ELBO at K=20 under plain,
STL and DReGs gradients, for three recognition models, evaluated under both bounds.

Generative model, top to bottom: z4 -> z8 -> z16 -> z32 -> z64 -> x (the name is
the number of units). Between stochastic layers sit two deterministic layers of
twice the units of the layer above (8, 16, 32, 64, 128), leaky ReLU, standard
deviations ``0.01 + softplus``, weight normalisation, Bernoulli pixels.

Recognition models, bottom to top:

- ``"factorised"``: a deterministic chain ``h_1 = MLP(x)``,
  ``h_i = MLP(Linear(h_{i-1}))``; each layer ``z_i ~ N(Linear(h_i), sd(h_i))`` given x only.
- ``"small"``: non-factorised, ``h_i = MLP(z_{i-1})`` with ``z_0 = x``; MLP widths 128, 64, 32, 16, 8.
- ``"large"``: the same with widths 512, 256, 128, 64, 32.

The factorised model uses the small widths. Under TMC_ELBO every layer gets its
own K particles; the non-factorised guides are drawn with ``proposal="mixture"``.
"""

import argparse
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from tqdm import tqdm

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_tmc import IWAE_ELBO, TMC_ELBO
from pyro_tmc.experiments import plots, report
from pyro_tmc.experiments.checkpoint import Checkpoint, CheckpointError
from pyro_tmc.experiments.datasets import load_dataset

LAYERS = (4, 8, 16, 32, 64)  # stochastic units, top to bottom
RECOGNITION_WIDTHS = {"small": (128, 64, 32, 16, 8), "large": (512, 256, 128, 64, 32)}
RECOGNITIONS = ("factorised", "small", "large")
OBJECTIVES = ("iwae", "tmc")
VARIANCE_REDUCTIONS = (None, "stl", "dregs")
CHECKPOINTS = "checkpoints"  # the folder, under --out, of each configuration's training checkpoint


def _linear(n_in: int, n_out: int) -> nn.Module:
    return weight_norm(nn.Linear(n_in, n_out))


def _mlp(n_in: int, width: int) -> nn.Sequential:
    """Two weight-normalised dense layers with leaky ReLU."""
    return nn.Sequential(_linear(n_in, width), nn.LeakyReLU(), _linear(width, width), nn.LeakyReLU())


def _batch_plate(x: torch.Tensor, num_data: Optional[int]) -> pyro.plate:
    # The caller draws the minibatch (dynamic binarisation needs the same draw in model
    # and guide), so the plate only sets the scale; its own subsample indices go unused.
    return pyro.plate("batch", num_data or len(x), subsample_size=len(x))


class GaussianHead(nn.Module):
    """``h -> (loc, 0.01 + softplus(.))``; the floor keeps standard deviations away from zero."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.loc = _linear(n_in, n_out)
        self.scale = _linear(n_in, n_out)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loc(h), 0.01 + F.softplus(self.scale(h))


class Generative(nn.Module):
    def __init__(self, data_dim: int) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(_mlp(n, 2 * n) for n in LAYERS)
        self.heads = nn.ModuleList(GaussianHead(2 * n, m) for n, m in zip(LAYERS, LAYERS[1:]))
        self.logits = _linear(2 * LAYERS[-1], data_dim)

    def model(self, x: torch.Tensor, num_data: Optional[int] = None) -> None:
        """
        :param torch.Tensor x: a binary batch, shape ``(batch, data_dim)``.
        :param int num_data: the data size that the batch stands for (its plate's scale
            is ``num_data / len(x)``); by default the batch is the whole data.
        """
        pyro.module("generative", self)
        with _batch_plate(x, num_data):
            z = pyro.sample(f"z{LAYERS[0]}", dist.Normal(x.new_zeros(LAYERS[0]), 1.0).to_event(1))
            for hidden, head, units in zip(self.hidden, self.heads, LAYERS[1:]):
                z = pyro.sample(f"z{units}", dist.Normal(*head(hidden(z))).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=self.logits(self.hidden[-1](z))).to_event(1), obs=x)


class FactorisedRecognition(nn.Module):
    """Every layer depends on x alone, through a deterministic chain mirroring the small model."""

    def __init__(self, data_dim: int) -> None:
        super().__init__()
        units = LAYERS[::-1]  # bottom to top
        widths = RECOGNITION_WIDTHS["small"]
        self.hidden = nn.ModuleList([_mlp(data_dim, widths[0])])
        self.hidden.extend(
            nn.Sequential(_linear(w_prev, n_prev), _mlp(n_prev, w))
            for w_prev, n_prev, w in zip(widths, units, widths[1:])
        )
        self.heads = nn.ModuleList(GaussianHead(w, n) for w, n in zip(widths, units))

    def guide(self, x: torch.Tensor, num_data: Optional[int] = None) -> None:
        pyro.module("recognition", self)
        with _batch_plate(x, num_data):
            h = x
            for hidden, head, units in zip(self.hidden, self.heads, LAYERS[::-1]):
                h = hidden(h)
                pyro.sample(f"z{units}", dist.Normal(*head(h)).to_event(1))


class NonFactorisedRecognition(nn.Module):
    """``Q(z_i | z_{i-1})`` through a two-layer MLP of ``z_{i-1}`` (``z_0 = x``)."""

    def __init__(self, data_dim: int, widths: Sequence[int]) -> None:
        super().__init__()
        units = LAYERS[::-1]
        inputs = (data_dim,) + units[:-1]
        self.hidden = nn.ModuleList(_mlp(n, w) for n, w in zip(inputs, widths))
        self.heads = nn.ModuleList(GaussianHead(w, n) for w, n in zip(widths, units))

    def guide(self, x: torch.Tensor, num_data: Optional[int] = None) -> None:
        pyro.module("recognition", self)
        with _batch_plate(x, num_data):
            z = x
            for hidden, head, units in zip(self.hidden, self.heads, LAYERS[::-1]):
                z = pyro.sample(f"z{units}", dist.Normal(*head(hidden(z))).to_event(1))


def recognition_model(name: str, data_dim: int) -> nn.Module:
    if name == "factorised":
        return FactorisedRecognition(data_dim)
    if name in RECOGNITION_WIDTHS:
        return NonFactorisedRecognition(data_dim, RECOGNITION_WIDTHS[name])
    raise ValueError(f"unknown recognition model {name!r}; expected one of {RECOGNITIONS}")


def make_elbo(objective: str, num_samples: int, variance_reduction: Optional[str] = None):
    """:param str objective: ``"iwae"`` or ``"tmc"``."""
    if objective == "tmc":
        return TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, variance_reduction=variance_reduction)
    if objective == "iwae":
        return IWAE_ELBO(num_samples=num_samples, max_plate_nesting=1, variance_reduction=variance_reduction)
    raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")


@dataclasses.dataclass
class TrainConfig:
    """Everything that builds one model, guide and loss and trains them: what a worker process needs."""

    recognition: str = "factorised"
    objective: str = "tmc"
    variance_reduction: Optional[str] = None
    num_samples: int = 20
    epochs: int = 1
    batch_size: int = 100
    device: str = "cpu"
    seed: int = 0


@dataclasses.dataclass
class TrainedVAE:
    generative: Generative
    recognition: nn.Module
    seconds_per_epoch: float  # mean step time after the first (warm-up) step, times steps per epoch
    steps: int
    final_loss: float  # minus the training bound per data point, mean of the last epoch
    first_step_seconds: float = float("nan")  # the warm-up step, excluded from seconds_per_epoch
    loss_history: list[list[float]] = dataclasses.field(default_factory=list)  # per epoch, per step


def binarise(images: torch.Tensor) -> torch.Tensor:
    """Dynamic binarisation: a fresh Bernoulli draw of the pixels every time a batch is used."""
    return torch.bernoulli(images)


def training_checkpoint(
    path: str, config: TrainConfig, images: torch.Tensor, optim, generative: nn.Module, recognition: nn.Module
) -> Checkpoint:
    """The checkpoint of one configuration's training: every setting but the number of epochs must match."""
    settings = {key: value for key, value in dataclasses.asdict(config).items() if key != "epochs"}
    settings["images"] = tuple(images.shape)
    modules = {"generative": generative, "recognition": recognition}
    return Checkpoint(path, optim, modules, hyper_parameters=settings)


def train(
    config: TrainConfig,
    images: torch.Tensor,
    progress: bool = True,
    checkpoint_path: Optional[str] = None,
    resume: bool = False,
) -> TrainedVAE:
    """
    Train one configuration with Adam (PyTorch defaults) on minibatches of ``images``.
    This is the unit of work of the grid; a multi-process launcher would call it
    once per worker (its data shard and device in ``config``).

    :param TrainConfig config: model, guide and loss construction, and training length.
    :param torch.Tensor images: grey levels in [0, 1), shape ``(n, data_dim)``.
    :param str checkpoint_path: where to save the training state at the end of each epoch
        (:class:`~pyro_tmc.experiments.checkpoint.Checkpoint`); None saves nothing.
    :param bool resume: continue from the checkpoint at ``checkpoint_path`` when there is one
        (a resumed run equals an uninterrupted one: same minibatches, draws, parameters and losses).
    :raises NotImplementedError: when the loss does not support the guide (TMC DReGs
        with a non-factorised recognition model), at the first step.
    :raises CheckpointError: when resuming a checkpoint of other settings, or of more epochs.
    """
    pyro.set_rng_seed(config.seed)
    pyro.clear_param_store()
    images = images.to(config.device)
    generative = Generative(images.shape[-1]).to(config.device)
    recognition = recognition_model(config.recognition, images.shape[-1]).to(config.device)
    elbo = make_elbo(config.objective, config.num_samples, config.variance_reduction)
    optim = Adam({})
    svi = SVI(generative.model, recognition.guide, optim, loss=elbo)
    checkpoint = None
    if checkpoint_path is not None:
        checkpoint = training_checkpoint(checkpoint_path, config, images, optim, generative, recognition)
    saved = checkpoint.resume(config.epochs) if checkpoint is not None and resume else {}
    history: list[list[float]] = saved.get("loss_history", [])
    step_seconds: list[float] = saved.get("step_seconds", [])
    steps_per_epoch = -(-len(images) // config.batch_size)
    bar = tqdm(
        total=config.epochs * steps_per_epoch,
        initial=len(step_seconds),
        desc=_label(config),
        disable=not progress,
        leave=False,
    )
    for epoch in range(len(history), config.epochs):
        losses = []
        for batch in torch.randperm(len(images), device=config.device).split(config.batch_size):
            start = time.perf_counter()
            losses.append(svi.step(binarise(images[batch])) / len(batch))  # .item() inside: synchronised
            step_seconds.append(time.perf_counter() - start)
            bar.update()
        history.append(losses)
        if checkpoint is not None:
            checkpoint.save(epoch + 1, len(step_seconds), loss_history=history, step_seconds=step_seconds)
    bar.close()
    # The first step warms up (lazy setup, caches, the allocator): it is timed apart.
    timed = step_seconds[1:] or step_seconds
    return TrainedVAE(
        generative,
        recognition,
        steps_per_epoch * sum(timed) / len(timed),
        len(step_seconds),
        sum(history[-1]) / len(history[-1]),
        step_seconds[0],
        history,
    )


def evaluate(
    trained: TrainedVAE,
    objective: str,
    images: torch.Tensor,
    num_samples: int,
    batch_size: int = 100,
    seed: int = 0,
) -> float:
    """The bound per data point on (freshly binarised) ``images``, averaged over batches."""
    pyro.set_rng_seed(seed)
    elbo = make_elbo(objective, num_samples)
    total = 0.0
    for batch in images.split(batch_size):
        x = binarise(batch.to(next(trained.generative.parameters()).device))
        total += elbo.log_evidence(trained.generative.model, trained.recognition.guide, x).item()
    return total / len(images)


def _label(config: TrainConfig) -> str:
    return f"{config.objective}/{config.variance_reduction or 'none'}/{config.recognition}"


def checkpoint_name(config: TrainConfig) -> str:
    """The file name of a configuration's checkpoint, e.g. ``tmc-none-factorised.ckpt``."""
    return _label(config).replace("/", "-") + ".ckpt"


def run_grid(
    configs: Sequence[TrainConfig],
    train_images: torch.Tensor,
    test_images: torch.Tensor,
    eval_samples: int,
    on_row: Optional[Callable[[list[dict]], None]] = None,
    checkpoint_dir: Optional[str] = None,
    resume: bool = False,
) -> list[dict]:
    """
    Train every configuration and evaluate it under both objectives; unsupported ones are rows
    marked skipped, with the reason.

    :param on_row: called with the rows so far after each configuration (e.g. to save them, so
        that a run stopped by a time limit keeps what it finished).
    :param str checkpoint_dir: where each configuration saves its training state every epoch
        (one file each, named by :func:`checkpoint_name`); None saves nothing.
    :param bool resume: continue each configuration from its checkpoint. A finished one is not
        trained again, only evaluated (with the same seeded draws, so the same numbers).
    """
    rows = []
    for config in tqdm(configs, desc="vae grid"):
        if on_row is not None and rows:
            on_row(rows)
        row = {
            "recognition": config.recognition,
            "trained with": config.objective,
            "variance reduction": config.variance_reduction or "none",
        }
        try:
            path = os.path.join(checkpoint_dir, checkpoint_name(config)) if checkpoint_dir else None
            trained = train(config, train_images, checkpoint_path=path, resume=resume)
        except NotImplementedError as error:
            rows.append(dict(row, note=f"skipped: {error}", reason=f"{type(error).__name__}: {error}"))
            continue
        row.update(
            {
                "train bound": -trained.final_loss,
                "test IWAE": evaluate(trained, "iwae", test_images, eval_samples),
                "test TMC": evaluate(trained, "tmc", test_images, eval_samples),
                "s/epoch": trained.seconds_per_epoch,
                "steps": trained.steps,
                "first step s": trained.first_step_seconds,
                "note": "",
            }
        )
        rows.append(row)
    return rows


class _Binarised(torch.utils.data.Dataset):
    """Images binarised afresh on every access: dynamic binarisation, once per batch for model and guide."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index):
        return binarise(self.images[index])


class _Program(nn.Module):
    """An nn.Module whose forward is a Pyro program of a submodule (what the Lightning wrapper calls)."""

    def __init__(self, module: nn.Module, program: str) -> None:
        super().__init__()
        self.module, self.program = module, program

    def forward(self, x: torch.Tensor, num_data: Optional[int] = None) -> None:
        getattr(self.module, self.program)(x, num_data)


def train_data_parallel(config: TrainConfig, images: torch.Tensor, devices: int) -> dict:
    """
    Train one configuration across ``devices`` processes (CPU: gloo; CUDA: one GPU each)
    with :func:`pyro_tmc.contrib.lightning.fit_data_parallel`; each process takes its own
    minibatches and the plate scales them to the whole data.

    :returns: a row: the final training bound per data point, samples per second, wall time.
    """
    from pyro_tmc.contrib.lightning import fit_data_parallel  # the optional lightning dependency

    pyro.clear_param_store()
    # Lightning owns the parameters: module-local, and only for this run (no global setting changed).
    with pyro.settings.context(module_local_params=True):
        generative = Generative(images.shape[-1])
        recognition = recognition_model(config.recognition, images.shape[-1])
        fit = fit_data_parallel(
            _Program(generative, "model"),
            _Program(recognition, "guide"),
            make_elbo(config.objective, config.num_samples, config.variance_reduction),
            _Binarised(images),
            devices,
            batch_size=config.batch_size,
            max_epochs=config.epochs,
            accelerator="gpu" if config.device.startswith("cuda") else "cpu",
            step_kwargs={"num_data": len(images)},
            loss_normaliser=float(len(images)),
            seed=config.seed,
        )
    losses = [row["train_loss"] for row in fit.history if "train_loss" in row]
    return {
        "recognition": config.recognition,
        "trained with": config.objective,
        "devices": devices,
        "train bound": -losses[-1] if losses else float("nan"),
        "samples/s": fit.samples_per_second,
        "wall s": fit.wall_seconds,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    report.add_common_arguments(parser, "vae")
    parser.add_argument(
        "--mnist",
        default=None,
        help="the pickled MNIST split (default: $PYRO_TMC_MNIST, else torchvision; "
        "--quick without either uses the embedded digits)",
    )
    parser.add_argument(
        "--recognition",
        nargs="+",
        default=list(RECOGNITIONS),
        choices=RECOGNITIONS,
        help="recognition models (--quick: factorised and small)",
    )
    parser.add_argument(
        "--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES, help="training objectives"
    )
    parser.add_argument(
        "--variance-reductions",
        nargs="+",
        default=["none", "stl", "dregs"],
        choices=["none", "stl", "dregs"],
        help="gradient estimators",
    )
    parser.add_argument(
        "--num-samples", type=int, default=20, help="K for training and evaluation (default: %(default)s)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="training epochs (default: %(default)s)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"continue a run in --out from its checkpoints (<out>/{CHECKPOINTS}/, saved at the end of "
        "every epoch: parameters, optimiser, random states); --epochs may be raised. The resumed run "
        "gives what an uninterrupted one would. Configurations without a checkpoint start afresh",
    )
    parser.add_argument("--batch-size", type=int, default=100, help="images per step (default: %(default)s)")
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="use the first n training images (default: all; --quick: 32)",
    )
    parser.add_argument(
        "--test-size", type=int, default=None, help="use the first n test images (default: all; --quick: 16)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="train the first configuration data-parallel across N processes (CPU) or "
        "GPUs (--device cuda) with PyTorch Lightning "
        "(pip install 'pyro-tmc[distributed]')",
    )


def _run_data_parallel(
    config: TrainConfig,
    train_images: torch.Tensor,
    args: argparse.Namespace,
    out: str,
    files: list[str],
    data: str,
    smoke: Optional[str],
) -> list[dict]:
    print(
        f"VAE, data-parallel over {args.devices} process(es): {config.recognition} recognition, "
        f"{config.objective}, K={config.num_samples}, {len(train_images)} images, {config.epochs} epoch(s)"
    )
    rows = [train_data_parallel(config, train_images, args.devices)]
    report.write_csv(rows, f"{out}/vae_data_parallel.csv")
    print(report.format_table(rows, list(rows[0]), floats="{:.2f}"))
    report.print_notes(
        [
            "train bound: the training bound per image at the last step; samples/s: the median over steps "
            "(all processes); wall s: the whole fit, process start-up included.",
            smoke,
        ]
    )
    report.finish(args, out, files, data)
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    """Paper Figs. 5 and 6: train the grid, evaluate each model under both bounds, tabulate and plot."""
    if args.devices and args.resume:
        raise CheckpointError(
            "--resume is not supported with --devices: the data-parallel fit saves no checkpoint."
        )
    files = (
        ["vae_data_parallel.csv"]
        if args.devices
        else ["vae.csv", "vae_bounds.png", "vae_time.png", CHECKPOINTS]
    )
    out = report.prepare_output(args, files)
    if args.quick:  # two steps per configuration; the large recognition model adds time, not coverage
        args.train_size, args.test_size = args.train_size or 32, args.test_size or 16
        args.batch_size, args.num_samples = min(args.batch_size, 16), min(args.num_samples, 4)
        if args.recognition == list(RECOGNITIONS):
            args.recognition = ["factorised", "small"]
    smoke = report.smoke_run_note(args, "untrained models (a couple of steps on a few images)")
    if smoke:
        print(smoke)
    dataset = load_dataset(args.mnist, embedded=args.quick)
    train_images = dataset["train"].images[: args.train_size]
    test_images = dataset["test"].images[: args.test_size]
    data = (
        f"{dataset.source}: {len(train_images)} training and {len(test_images)} test images "
        f"of {train_images.shape[-1]} pixels"
    )
    report.print_data(data)
    configs = [
        TrainConfig(
            recognition,
            objective,
            None if vr == "none" else vr,
            args.num_samples,
            args.epochs,
            args.batch_size,
            device=args.device,
            seed=args.seed,
        )
        for recognition in args.recognition
        for objective in args.objectives
        for vr in args.variance_reductions
    ]
    if args.devices:  # the first TMC configuration of the grid
        config = next((c for c in configs if c.objective == "tmc"), configs[0])
        return _run_data_parallel(config, train_images, args, out, files, data, smoke)
    print(
        f"VAE grid: {len(configs)} configurations, K={args.num_samples}, {args.epochs} epoch(s) "
        f"of batches of {args.batch_size}"
    )

    def save(rows_so_far):
        report.write_csv(rows_so_far, f"{out}/vae.csv")

    checkpoints = os.path.join(out, CHECKPOINTS)
    if args.resume:
        found = sum(os.path.exists(os.path.join(checkpoints, checkpoint_name(c))) for c in configs)
        print(f"resume: {found} of {len(configs)} configurations have a checkpoint in {checkpoints}")
    rows = run_grid(
        configs, train_images, test_images, args.num_samples, save, checkpoints, resume=args.resume
    )
    save(rows)
    columns = [
        "recognition",
        "trained with",
        "variance reduction",
        "train bound",
        "test IWAE",
        "test TMC",
        "s/epoch",
        "note",
    ]
    print(report.format_table(rows, columns, floats="{:.2f}"))
    report.print_notes(
        [
            "train bound: the training bound per image, mean over the last epoch; test IWAE / test TMC: "
            f"the bound per test image under IWAE / TMC with K={args.num_samples} (one draw, no ±).",
            "s/epoch: seconds per epoch, from the mean step time after the first step "
            "(warm-up: excluded, in vae.csv as 'first step s').",
            "Blank: a skipped configuration (the reason in 'note')."
            if any(r["note"] for r in rows)
            else None,
            smoke,
        ]
    )
    plots.vae_figures(rows, out)
    report.finish(args, out, files, data)
    return rows
