"""Figures of the experiments, drawn from their result rows (the computing is in toy.py, chain.py, vae.py)."""

from collections.abc import Sequence

COLOURS = {"TMC": "tab:red", "SMC": "tab:green", "IWAE": "tab:blue", "exact": "black"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in tests
    import matplotlib.pyplot as plt

    return plt


def _series(rows: Sequence[dict], method: str, x: str, y: str):
    points = sorted((row[x], row[y], row.get("se", 0.0)) for row in rows if row["method"] == method)
    return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]


def toy_figure(k_rows: Sequence[dict], n_rows: Sequence[dict], path: str) -> None:
    """
    Paper Fig. 3: bound (A) and time (B) vs K at fixed N; bound per data point (C) and time (D)
    vs N at fixed K.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for rows, x, ax_bound, ax_time, per_point in (
        (k_rows, "K", axes[0], axes[1], False),
        (n_rows, "N", axes[2], axes[3], True),
    ):
        for method in ("IWAE", "SMC", "TMC", "exact"):
            xs, ys, ses = _series(rows, method, x, "mean")
            if not xs:
                continue
            if per_point:
                ns = _series(rows, method, x, "N")[1]
                ys, ses = [y / n for y, n in zip(ys, ns)], [s / n for s, n in zip(ses, ns)]
            ax_bound.errorbar(
                xs,
                ys,
                yerr=ses,
                label=method,
                color=COLOURS[method],
                marker=".",
                linestyle="--" if method == "exact" else "-",
            )
            if method != "exact":
                ax_time.plot(
                    xs,
                    _series(rows, method, x, "seconds")[1],
                    label=method,
                    color=COLOURS[method],
                    marker=".",
                )
        ylabel = "log p(x) per data point" if per_point else "log p(x) estimate"
        ax_bound.set(xscale="log", xlabel=x, ylabel=ylabel)
        ax_time.set(xscale="log", yscale="log", xlabel=x, ylabel="seconds per estimate")
    for ax, letter in zip(axes, "ABCD"):
        ax.set_title(letter, loc="left", fontweight="bold")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def chain_figure(rows: Sequence[dict], exact: float, path: str) -> None:
    """Paper Fig. 4: bound vs K for each proposal, against the exact log p(x)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in dict.fromkeys(row["method"] for row in rows):
        xs, ys, ses = _series(rows, method, "K", "mean")
        ax.errorbar(xs, ys, yerr=ses, label=method, marker=".")
    ax.axhline(exact, color="black", linestyle="--", label="exact")
    # symlog: the factorised proposal at small K sits hundreds of nats below the rest
    ax.set(xscale="log", xlabel="K", ylabel="log p(x) estimate (symlog)")
    ax.set_yscale("symlog", linthresh=2.0)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def vae_figures(rows: Sequence[dict], out: str) -> None:
    """Paper Fig. 5 (``vae_bounds.png``: test bounds by recognition model) and Fig. 6 (``vae_time.png``)."""
    plt = _pyplot()
    trained = [row for row in rows if "test TMC" in row]
    recognitions = list(dict.fromkeys(row["recognition"] for row in rows))
    reductions = list(dict.fromkeys(row["variance reduction"] for row in rows))
    panels = (
        ("A: trained with IWAE / TMC, evaluated with TMC", [("iwae", "test TMC"), ("tmc", "test TMC")]),
        ("B: trained with IWAE", [("iwae", "test IWAE"), ("iwae", "test TMC")]),
        ("C: trained with TMC", [("tmc", "test IWAE"), ("tmc", "test TMC")]),
    )
    fig, axes = plt.subplots(3, len(recognitions), figsize=(4 * len(recognitions), 9), squeeze=False)
    for col, recognition in enumerate(recognitions):
        for row_index, (title, lines) in enumerate(panels):
            ax = axes[row_index][col]
            for objective, column in lines:
                points = _vae_points(trained, recognition, objective, column, reductions)
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker="o",
                    label=f"trained {objective.upper()}, {column}",
                    color=COLOURS["TMC" if column == "test TMC" else "IWAE"],
                    linestyle="-" if objective == "tmc" else ":",
                )
            ax.set_title(f"{title}\n{recognition}", fontsize="small")
            ax.legend(fontsize="x-small")
        axes[0][col].set_ylabel("test bound per image")
    fig.tight_layout()
    fig.savefig(f"{out}/vae_bounds.png", dpi=70)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    labels, seconds = _mean_epoch_times(trained)
    ax.bar(labels, seconds, color=[COLOURS["TMC" if lab.startswith("TMC") else "IWAE"] for lab in labels])
    ax.set(ylabel="s / epoch (mean over models)")
    ax.tick_params(axis="x", labelsize="small")
    fig.tight_layout()
    fig.savefig(f"{out}/vae_time.png", dpi=80)
    plt.close(fig)


def _vae_points(rows, recognition: str, objective: str, column: str, reductions: Sequence[str]) -> list:
    found = {
        row["variance reduction"]: row[column]
        for row in rows
        if row["recognition"] == recognition and row["trained with"] == objective
    }
    return [(reduction, found[reduction]) for reduction in reductions if reduction in found]


def _mean_epoch_times(rows):
    times: dict[str, list[float]] = {}
    for row in rows:
        label = f"{row['trained with'].upper()} {row['variance reduction']}"
        times.setdefault(label, []).append(row["s/epoch"])
    labels = list(times)  # grid order: none, stl, dregs
    return labels, [sum(times[label]) / len(times[label]) for label in labels]
