"""What every experiment shares: its command-line options, output folder, tables and result files."""

import argparse
import csv
import json
import math
import os
import platform
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch

RUN_INFO = "run.json"
SE_NOTE = "±: the standard error of the mean over {repeats} independent estimates."
BOUND_NOTE = (
    "Each estimate is the log of an unbiased estimate of p(x): a lower bound on log p(x) in "
    "expectation; a single estimate, or the mean of a few, can lie above the exact value."
)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's intra-op threads for the run (1 by default; 0 keeps torch's own default)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default: %(default)s, fastest for these small models on "
        "shared cores; 0: torch's default, one per core)",
    )


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """
    The options of every experiment: ``--device``, ``--quick``, ``--out``, ``--overwrite``, ``--seed``,
    ``--threads``.
    """
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: tiny sizes, seconds; checks that everything runs, its numbers are not results",
    )
    parser.add_argument(
        "--out",
        default=os.path.join("results", name),
        help="folder for tables, figures and run.json, relative to the current directory "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of a previous run in --out (without it, such a folder is refused)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    add_threads_argument(parser)


def output_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def prepare_output(args: argparse.Namespace, files: Sequence[str]) -> str:
    """
    The output folder ``args.out``, created; checked before the run starts, so that no work is lost.

    :param files: the names of the files the run will write there (``run.json`` is added).
    :raises FileExistsError: when the folder holds a previous run's files and neither ``args.overwrite``
        nor ``args.resume`` (continue that run) is set.
    """
    out = args.out
    found = [name for name in list(files) + [RUN_INFO] if os.path.exists(os.path.join(out, name))]
    if found and not (getattr(args, "overwrite", False) or getattr(args, "resume", False)):
        resume = ", --resume to continue it," if hasattr(args, "resume") else ""
        raise FileExistsError(
            f"{out} already holds a previous run ({', '.join(found)}): pass --overwrite to replace it"
            f"{resume} or --out to write elsewhere."
        )
    return output_dir(out)


def smoke_run_note(args: argparse.Namespace, what: str) -> Optional[str]:
    """The line that marks a ``--quick`` run (None for a full run)."""
    if not args.quick:
        return None
    return f"SMOKE RUN (--quick): {what}: numbers are not results."


def print_data(description: str) -> None:
    print(f"data: {description}")


def finish(args: argparse.Namespace, out: str, files: Sequence[str], data: str, **extra) -> None:
    """Write ``run.json`` (what ran, on what data, with which versions) and print where everything went."""
    import pyro

    from pyro_tmc import __version__

    write_json(
        dict(
            {
                "command": " ".join(["python -m pyro_tmc"] + list(getattr(args, "argv", sys.argv[1:]))),
                "arguments": {key: value for key, value in vars(args).items() if key != "argv"},
                "smoke run": bool(args.quick),
                "data": data,
                "torch threads": torch.get_num_threads(),
                "versions": {
                    "pyro_tmc": __version__,
                    "pyro": pyro.__version__,
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                },
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            **extra,
        ),
        os.path.join(out, RUN_INFO),
    )
    names = ", ".join(list(files) + [RUN_INFO])
    print(f"wrote {os.path.abspath(out)}{os.sep}: {names}")


def print_notes(notes: Sequence[Optional[str]]) -> None:
    """The legend below a table, one note a line; None entries are left out."""
    for note in notes:
        if note:
            print(textwrap.fill(note, width=100, initial_indent="  ", subsequent_indent="    "))


def write_csv(rows: Sequence[dict], path: str) -> None:
    """Rows of flat dicts; the columns are the union of their keys, in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def format_table(
    rows: Sequence[dict], columns: Sequence[str], floats: str = "{:.3f}", left: Sequence[str] = ("note",)
) -> str:
    """
    A fixed-width text table of ``columns``; floats formatted by ``floats``, missing cells blank.
    Columns named in ``left`` (free text) are left-aligned, the others right-aligned.
    """

    def cell(value) -> str:
        if isinstance(value, float):
            return floats.format(value)
        return "" if value is None else str(value)

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def justify(value: str, column: str, width: int) -> str:
        return value.ljust(width) if column in left else value.rjust(width)

    lines = ["  ".join(justify(c, c, w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(justify(v, c, w) for v, c, w in zip(r, columns, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def mean_and_se(values: Sequence[float]) -> dict[str, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return {"mean": mean, "se": math.sqrt(var / len(values))}


def timed_draws(draw: Callable[[], float], repeats: int, device: str) -> dict[str, float]:
    """
    Mean and standard error of ``repeats`` calls of ``draw``, and seconds per call; one warm-up
    call first, excluded from both.
    """
    draw()  # warm-up: plate nesting guess, caches, allocator
    values = []
    start = time.perf_counter()
    for _ in range(repeats):
        values.append(draw())
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return dict(mean_and_se(values), seconds=(time.perf_counter() - start) / repeats)
