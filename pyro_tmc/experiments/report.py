"""What every experiment shares: its command-line options, output folder, tables and result files."""

import argparse
import csv
import json
import math
import os
import time
from typing import Callable, Dict, List, Sequence

import torch


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options of every experiment: ``--device``, ``--quick``, ``--out``, ``--seed``."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, for tests (seconds)")
    parser.add_argument("--out", default=os.path.join("results", name), help="folder for tables and figures")
    parser.add_argument("--seed", type=int, default=0)


def output_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def write_csv(rows: Sequence[Dict], path: str) -> None:
    """Rows of flat dicts; the columns are the union of their keys, in first-seen order."""
    columns: List[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def format_table(rows: Sequence[Dict], columns: Sequence[str], floats: str = "{:.3f}") -> str:
    """A fixed-width text table of ``columns``; floats formatted by ``floats``, missing cells blank."""

    def cell(value) -> str:
        if isinstance(value, float):
            return floats.format(value)
        return "" if value is None else str(value)

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def mean_and_se(values: Sequence[float]) -> Dict[str, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return {"mean": mean, "se": math.sqrt(var / len(values))}


def timed_draws(draw: Callable[[], float], repeats: int, device: str) -> Dict[str, float]:
    """Mean and standard error of ``repeats`` calls of ``draw`` (after one warm-up call), and seconds per call."""
    draw()  # warm-up: plate nesting guess, caches, allocator
    values = []
    start = time.perf_counter()
    for _ in range(repeats):
        values.append(draw())
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return dict(mean_and_se(values), seconds=(time.perf_counter() - start) / repeats)
