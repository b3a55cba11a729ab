"""
A longer VAE run (issue 13): the factorised recognition model trained with IWAE or TMC (plain
gradient, K=20) on MNIST for several epochs, the test bound under both estimators after every epoch.

Reuses the package's VAE (:mod:`pyro_tmc.experiments.vae`). One objective per process, so the two
can run side by side::

    python benchmarks/vae_long_run.py --mnist PATH --objective iwae --epochs 20 --out results/vae_long
    python benchmarks/vae_long_run.py --mnist PATH --objective tmc  --epochs 20 --out results/vae_long
    python benchmarks/vae_long_run.py --plot-only --out results/vae_long   # the combined figure and table

MNIST comes from ``--mnist`` or ``$PYRO_TMC_MNIST`` (else torchvision). Writes
``<out>/vae_long_<objective>.csv`` after every epoch (so a cut-short run keeps its epochs),
``<out>/vae_long_<objective>.png`` and, with ``--plot-only``, ``<out>/vae_long.png`` and
``<out>/vae_long.md``.

After every epoch it also saves ``<out>/vae_long_<objective>.ckpt`` (parameters, Adam's state, the
random states, the rows so far); ``--resume`` continues a run that was stopped, and gives what an
uninterrupted run would (timings aside)::

    python benchmarks/vae_long_run.py --mnist PATH --objective tmc --epochs 20 --out results/vae_long --resume
"""

import argparse
import csv
import math
import os
import time

import torch
from tqdm import tqdm

import pyro
from pyro.infer import SVI
from pyro.optim import Adam

from pyro_tmc.experiments.checkpoint import Checkpoint, CheckpointError
from pyro_tmc.experiments.datasets import load_dataset
from pyro_tmc.experiments.vae import Generative, binarise, make_elbo, recognition_model

FIELDS = [
    "objective",
    "epoch",
    "steps",
    "train bound",
    "test IWAE",
    "test IWAE se",
    "test TMC",
    "test TMC se",
    "train s",
    "eval s",
    "wall s",
]


def evaluate_batches(generative, recognition, objective, images, num_samples, batch_size, seed):
    """The bound per test image and its standard error (over the per-batch means: data and sampling)."""
    pyro.set_rng_seed(seed)  # the same binarisation and draws at every epoch
    elbo = make_elbo(objective, num_samples)
    means = []
    with torch.no_grad():
        for batch in images.split(batch_size):
            x = binarise(batch)
            means.append(elbo.log_evidence(generative.model, recognition.guide, x).item() / len(batch))
    n = len(means)
    mean = sum(means) / n
    var = sum((m - mean) ** 2 for m in means) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path):
    with open(path) as f:
        return [
            {k: (v if k == "objective" else float(v)) for k, v in row.items()} for row in csv.DictReader(f)
        ]


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {"iwae": "tab:blue", "tmc": "tab:red"}
    for objective, rows in runs.items():
        epochs = [r["epoch"] for r in rows]
        for estimator, style in (("IWAE", "--"), ("TMC", "-")):
            ax.errorbar(
                epochs,
                [r[f"test {estimator}"] for r in rows],
                yerr=[r[f"test {estimator} se"] for r in rows],
                linestyle=style,
                marker="o",
                markersize=3,
                capsize=2,
                color=colours.get(objective),
                label=f"trained with {objective.upper()}, evaluated with {estimator}",
            )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test bound per image (nats, K=20)")
    ax.set_title("MNIST VAE, factorised recognition, plain gradients")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(runs):
    lines = [
        "| trained with | epoch | train bound | test IWAE ± se | test TMC ± se | train s | eval s |",
        "|---|---|---|---|---|---|---|",
    ]
    for objective, rows in runs.items():
        for r in rows:
            lines.append(
                f"| {objective.upper()} | {int(r['epoch'])} | {r['train bound']:.1f} | "
                f"{r['test IWAE']:.2f} ± {r['test IWAE se']:.2f} | "
                f"{r['test TMC']:.2f} ± {r['test TMC se']:.2f} | "
                f"{r['train s']:.0f} | {r['eval s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def combine(out):
    runs = {}
    for objective in ("iwae", "tmc"):
        path = os.path.join(out, f"vae_long_{objective}.csv")
        if os.path.exists(path):
            runs[objective] = read_csv(path)
    plot(runs, os.path.join(out, "vae_long.png"))
    with open(os.path.join(out, "vae_long.md"), "w") as f:
        f.write(markdown(runs))
    print(f"wrote {out}/vae_long.png and {out}/vae_long.md")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mnist", default=None, help="the pickled MNIST split (default: $PYRO_TMC_MNIST)")
    parser.add_argument("--out", default="results/vae_long", help="output folder (default: %(default)s)")
    parser.add_argument("--objective", choices=("iwae", "tmc"), default="tmc", help="training objective")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument(
        "--num-samples", type=int, default=20, help="K, training and test (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=100, help="default: %(default)s")
    parser.add_argument("--train-size", type=int, default=None, help="first n training images (default: all)")
    parser.add_argument("--test-size", type=int, default=None, help="first n test images (default: all)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after n steps (timing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from <out>/vae_long_<objective>.ckpt (saved after every epoch: parameters, "
        "optimiser, random states, the rows written); --epochs may be raised. The resumed run writes "
        "what an uninterrupted one would (timings aside). Without a checkpoint, start afresh",
    )
    parser.add_argument(
        "--plot-only", action="store_true", help="combine the CSVs in --out into a figure and table"
    )
    return parser.parse_args(argv)


def resume(checkpoint, epochs):
    """What ``checkpoint`` saved (its state restored): rows, loss history, step count; {} without one."""
    try:
        saved = checkpoint.resume(epochs)
    except CheckpointError as error:
        raise SystemExit(f"vae_long_run.py: error: {error}") from None
    where = f"after epoch {saved['epoch']}" if saved else "none there, starting afresh"
    print(f"resume: {checkpoint.path}: {where}", flush=True)
    return saved


def main(argv=None):
    args = parse_arguments(argv)
    if args.plot_only:
        combine(args.out)
        return
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)

    dataset = load_dataset(args.mnist)
    train_images = dataset["train"].images[: args.train_size]
    test_images = dataset["test"].images[: args.test_size]
    print(f"data: {dataset.source}: {len(train_images)} training, {len(test_images)} test images", flush=True)

    pyro.set_rng_seed(args.seed)
    pyro.clear_param_store()
    generative = Generative(train_images.shape[-1])
    recognition = recognition_model("factorised", train_images.shape[-1])
    optim = Adam({})
    svi = SVI(generative.model, recognition.guide, optim, loss=make_elbo(args.objective, args.num_samples))
    settings = {key: getattr(args, key) for key in ("objective", "num_samples", "batch_size", "seed")}
    settings.update(train=tuple(train_images.shape), test=tuple(test_images.shape))
    checkpoint = Checkpoint(
        os.path.join(args.out, f"vae_long_{args.objective}.ckpt"),
        optim,
        {"generative": generative, "recognition": recognition},
        hyper_parameters=settings,
    )
    saved = resume(checkpoint, args.epochs) if args.resume else {}
    rows, loss_history, steps = (
        saved.get("rows", []),
        saved.get("loss_history", []),
        saved.get("global_step", 0),
    )
    num_data = len(train_images)
    # wall s counts on from the interrupted run's
    start = time.perf_counter() - (rows[-1]["wall s"] if rows else 0.0)
    csv_path = os.path.join(args.out, f"vae_long_{args.objective}.csv")
    for epoch in range(len(rows) + 1, args.epochs + 1):
        t0, losses = time.perf_counter(), []
        batches = torch.randperm(num_data).split(args.batch_size)
        for batch in tqdm(batches, desc=f"{args.objective} epoch {epoch}", mininterval=10):
            losses.append(svi.step(binarise(train_images[batch])) / len(batch))  # as vae.train
            steps += 1
            if args.max_steps and steps >= args.max_steps:
                elapsed = time.perf_counter() - t0
                print(f"{steps} steps in {elapsed:.1f} s: {elapsed / steps:.3f} s/step", flush=True)
                return
        train_s = time.perf_counter() - t0
        loss_history.append(losses)
        t0 = time.perf_counter()
        row = {
            "objective": args.objective,
            "epoch": epoch,
            "steps": steps,
            "train bound": -sum(losses) / len(losses),
        }
        for estimator in ("iwae", "tmc"):
            mean, se = evaluate_batches(
                generative,
                recognition,
                estimator,
                test_images,
                args.num_samples,
                args.batch_size,
                args.seed + 1,
            )
            row[f"test {estimator.upper()}"], row[f"test {estimator.upper()} se"] = mean, se
        row.update(
            {"train s": train_s, "eval s": time.perf_counter() - t0, "wall s": time.perf_counter() - start}
        )
        rows.append(row)
        write_csv(rows, csv_path)
        # After the evaluation, whose reseeding the random states saved here include.
        checkpoint.save(epoch, steps, rows=rows, loss_history=loss_history)
        print(
            f"epoch {epoch}: train {row['train bound']:.2f}, test IWAE {row['test IWAE']:.2f} ± "
            f"{row['test IWAE se']:.2f}, TMC {row['test TMC']:.2f} ± {row['test TMC se']:.2f} "
            f"({train_s:.0f} s train, {row['eval s']:.0f} s eval)",
            flush=True,
        )
        plot({args.objective: rows}, os.path.join(args.out, f"vae_long_{args.objective}.png"))
    state = {"generative": generative.state_dict(), "recognition": recognition.state_dict()}
    torch.save(state, os.path.join(args.out, f"vae_long_{args.objective}.pt"))
    print(f"wrote {csv_path}", flush=True)


if __name__ == "__main__":
    main()
