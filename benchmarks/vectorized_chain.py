"""The Fig. 4 chain written with Pyro's ``vectorized_markov``, beside the hand-written log-depth tree.

    python benchmarks/vectorized_chain.py                 # CPU, 1 thread, N=100 and N=1000, K=32
    python benchmarks/vectorized_chain.py --quick         # a smoke run

The current results: ``benchmarks/results/vectorized_chain_cpu.md``.

The chain of ``benchmarks/frontier.py`` (``z_i ~ N(z_{i-1}, 1/N)``, ``x ~ N(z_N, 1)``, a
factorised guide with a learnable loc / log-scale per step) written with
:func:`pyro.contrib.funsor.vectorized_markov`: one sample statement for steps 2..N, so the
model's ``log p(z_t | z_{t-1})`` is one stacked ``(N-1, K, K)`` tensor and the time dim is
contracted by ``sequential_log_matmul_exp`` (:mod:`pyro_tmc.estimate.vectorized_markov`). Rows:

- ``vectorized_markov``: ``TMC_ELBO`` eagerly, then ``compile="inductor"`` (the estimate
  compiled) and ``compile="inductor", whole step`` (guide, model, estimate and gradients
  captured into one graph, :mod:`pyro_tmc.compile.captured_step`); the compile column is the first
  call(s), apart from the step time;
- ``pyro.markov``: the same chain unrolled, one sample statement per step (frontier's row);
- the hand-written log-depth tree of ``frontier.py`` (``chain_log_factors`` +
  ``tree_contract``), eager and under ``torch.compile``, and its exact twin compiled
  (``static_exact_tree_contract``: float64, then the underflowed entries by max-plus).

Each step is one forward + backward; medians of interleaved rounds; the last column is the
time over the eager hand-written tree.

Measured on the shared 2-core CPU (AMD EPYC, under load from other sessions: the eager tree
took 89-127 ms at N=1000 here, 29-71 ms in quieter runs of frontier.py), 1 torch thread,
torch 2.13, one run each of ``--chains observed`` and ``--chains fig4`` (ms per step; the
compile column is the first call(s), apart; for a whole step, its first three calls:
eager, capture, first replay, where inductor compiles):

| case | method | ms / step | compile s | x tree |
|---|---|---|---|---|
| observed chain T=100 K=32 | vectorized_markov, eager | 62.94 | - | 2.83 |
| observed chain T=100 K=32 | pyro_tmc TMC_ELBO compile='graph', estimate only | 64.55 | 0.5 | 2.90 |
| observed chain T=100 K=32 | pyro_tmc TMC_ELBO compile='graph', whole step | 32.04 | 1.6 | 1.44 |
| observed chain T=100 K=32 | pyro_tmc TMC_ELBO compile='inductor', estimate only | 52.96 | 27.5 | 2.38 |
| observed chain T=100 K=32 | pyro_tmc TMC_ELBO compile='inductor', whole step | 12.56 | 2.1 (*) | 0.56 |
| observed chain T=100 K=32 | pyro.markov, eager | 169.28 | - | 7.61 |
| observed chain T=100 K=32 | hand-written log-depth tree | 22.24 | - | 1.00 |
| observed chain T=100 K=32 | hand-written log-depth tree, torch.compile | 14.84 | 28.3 | 0.67 |
| observed chain T=1000 K=32 | vectorized_markov, eager | 155.03 | - | 1.75 |
| observed chain T=1000 K=32 | pyro_tmc TMC_ELBO compile='graph', estimate only | 150.95 | 2.8 | 1.70 |
| observed chain T=1000 K=32 | pyro_tmc TMC_ELBO compile='graph', whole step | 77.87 | 7.3 | 0.88 |
| observed chain T=1000 K=32 | pyro_tmc TMC_ELBO compile='inductor', estimate only | 165.16 | 61.6 | 1.86 |
| observed chain T=1000 K=32 | pyro_tmc TMC_ELBO compile='inductor', whole step | 32.27 | 3.4 (*) | 0.36 |
| observed chain T=1000 K=32 | pyro.markov, eager | 1310.47 | - | 14.77 |
| observed chain T=1000 K=32 | hand-written log-depth tree | 88.71 | - | 1.00 |
| observed chain T=1000 K=32 | hand-written log-depth tree, torch.compile | 35.92 | 58.2 | 0.40 |
| Fig. 4 chain N=100 K=32 | vectorized_markov, eager | 32.25 | - | 3.01 |
| Fig. 4 chain N=100 K=32 | pyro_tmc TMC_ELBO compile='graph', estimate only | 43.36 | 0.6 | 4.04 |
| Fig. 4 chain N=100 K=32 | pyro_tmc TMC_ELBO compile='graph', whole step | 57.06 | 1.8 | 5.32 |
| Fig. 4 chain N=100 K=32 | pyro_tmc TMC_ELBO compile='inductor', estimate only | 45.58 | 4.6 | 4.25 |
| Fig. 4 chain N=100 K=32 | pyro_tmc TMC_ELBO compile='inductor', whole step | 44.33 | 16.4 | 4.13 |
| Fig. 4 chain N=100 K=32 | pyro.markov, eager | 63.28 | - | 5.90 |
| Fig. 4 chain N=100 K=32 | hand-written log-depth tree | 10.73 | - | 1.00 |
| Fig. 4 chain N=100 K=32 | hand-written log-depth tree, torch.compile | 2.91 | 3.0 | 0.27 |
| Fig. 4 chain N=1000 K=32 | vectorized_markov, eager | 481.91 | - | 3.79 |
| Fig. 4 chain N=1000 K=32 | pyro_tmc TMC_ELBO compile='graph', estimate only | 604.61 | 1.7 | 4.76 |
| Fig. 4 chain N=1000 K=32 | pyro_tmc TMC_ELBO compile='graph', whole step | 898.64 | 3.5 | 7.07 |
| Fig. 4 chain N=1000 K=32 | pyro_tmc TMC_ELBO compile='inductor', estimate only | 564.06 | 12.6 | 4.44 |
| Fig. 4 chain N=1000 K=32 | pyro_tmc TMC_ELBO compile='inductor', whole step | 649.93 | 32.1 | 5.11 |
| Fig. 4 chain N=1000 K=32 | pyro.markov, eager | 958.72 | - | 7.54 |
| Fig. 4 chain N=1000 K=32 | hand-written log-depth tree | 127.11 | - | 1.00 |
| Fig. 4 chain N=1000 K=32 | hand-written log-depth tree, torch.compile | 49.01 | 20.9 | 0.39 |

(*) the observed rows were run before the whole-step rows timed their third call, where inductor
compiles: these two compile figures leave it out. A rerun at commit 75d551f (``--chains observed
--sizes 1000 --no-unrolled``) gave, T=1000: eager 134.5 ms; whole step inductor 22.4 ms, its
first three calls 15.9 s; eager tree 105.1 ms; compiled tree 32.7 ms (0.21x and 0.31x the
eager tree).

-log P_TMC over 20 fresh draws at the guide's init (mean +- sd), vectorized_markov /
pyro.markov / hand-written: observed T=100: 158.96 +- 4.22 / 160.29 +- 2.57 / 158.84 +- 3.60;
T=1000: 7146.9 +- 52.1 / 7137.2 +- 45.2 / 7152.4 +- 59.6; Fig. 4 N=100: 4.05 +- 1.80 /
3.50 +- 1.63 / 3.40 +- 1.92; N=1000: 155.0 +- 23.5 / 153.5 +- 17.4 / 158.8 +- 21.9.

Reading it:

- observed chain (every step observed, a guide near the posterior): the whole step captured
  and compiled is 0.36x the eager tree at T=1000 (0.9x the compiled tree), and 0.56x at T=100;
  eagerly, vectorized_markov is 8x faster than the unrolled ``pyro.markov`` chain;
- Fig. 4 chain (step scale ``1/sqrt(N)``, far below the particles' spread): nearly every link
  product underflows when shifted, so pyro_tmc's exact repair (``pyro_tmc/ops/underflow.py``)
  runs, and a captured step with an underflow runs again eagerly: the compiled rows are no
  faster than eager. The unrolled chain pays the same repair; the hand-written tree makes none.
- the estimates agree in distribution (the notes: -log P_TMC over 20 fresh draws each).
"""

import argparse
import math
import os
import sys
import time
from typing import Callable, NamedTuple

import torch
from torch.distributions import Normal

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.contrib.funsor import vectorized_markov

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frontier  # noqa: E402

from pyro_tmc import TMC_ELBO  # noqa: E402

TREE = "hand-written log-depth tree"


def vectorized_chain_model(x, N):
    """frontier's chain with vectorized_markov: z_1, then z_2..z_N in one statement (steps from 0)."""
    scale = math.sqrt(1.0 / N)
    z_prev = x.new_zeros(())
    for t in vectorized_markov(name="time", size=N, dim=-1):
        z_curr = pyro.sample(f"z_{t}", dist.Normal(z_prev, scale))
        # x is observed at the last step: inside the loop, masked elsewhere (a site after the
        # loop may not read the time dim: TMC cannot tell which step it read)
        with poutine.mask(mask=torch.as_tensor(t) == N - 1):
            pyro.sample(f"x_{t}", dist.Normal(z_curr, 1.0), obs=x)
        z_prev = z_curr


def vectorized_chain_guide(x, N):
    """frontier's factorised guide, its steps drawn by the same loop."""
    loc = pyro.param("chain_loc", lambda: frontier.chain_init(N, x)[0])
    log_scale = pyro.param("chain_log_scale", lambda: frontier.chain_init(N, x)[1])
    for t in vectorized_markov(name="time", size=N, dim=-1):
        pyro.sample(f"z_{t}", dist.Normal(loc[t], log_scale[t].exp()))


#: the step scale of the observed chain (the model of docs/performance.md)
STEP_SCALE = 0.3


def observed_chain_data(N: int) -> torch.Tensor:
    """A fixed draw of x from the observed chain (seeded)."""
    generator = torch.Generator().manual_seed(0)
    z = (STEP_SCALE * torch.randn(N, generator=generator)).cumsum(0)
    return z + torch.randn(N, generator=generator)


def observed_chain_model(x):
    """z_0 ~ N(0, s), z_t ~ N(z_{t-1}, s), x_t ~ N(z_t, 1), every step observed."""
    z_prev = 0.0
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        z_curr = pyro.sample(f"z_{t}", dist.Normal(z_prev, STEP_SCALE))
        pyro.sample(f"x_{t}", dist.Normal(z_curr, 1.0), obs=x[t])
        z_prev = z_curr


def observed_chain_unrolled(x):
    """The same chain with pyro.markov."""
    z = 0.0
    for t in pyro.markov(range(x.shape[-1])):
        z = pyro.sample(f"z_{t}", dist.Normal(z, STEP_SCALE))
        pyro.sample(f"x_{t}", dist.Normal(z, 1.0), obs=x[t])


def observed_chain_init(x):
    """The guide's initial value: near the posterior (loc 0.6 x, scale 0.5)."""
    return 0.6 * x, torch.full_like(x, math.log(0.5))


def observed_chain_guide(x):
    """Factorised over time, learnable loc / log-scale per step."""
    loc = pyro.param("obs_loc", lambda: observed_chain_init(x)[0])
    log_scale = pyro.param("obs_log_scale", lambda: observed_chain_init(x)[1])
    for t in vectorized_markov(name="time", size=x.shape[-1], dim=-1):
        pyro.sample(f"z_{t}", dist.Normal(loc[t], log_scale[t].exp()))


def observed_chain_unrolled_guide(x):
    loc = pyro.param("obs_loc", lambda: observed_chain_init(x)[0])
    log_scale = pyro.param("obs_log_scale", lambda: observed_chain_init(x)[1])
    for t in pyro.markov(range(x.shape[-1])):
        pyro.sample(f"z_{t}", dist.Normal(loc[t], log_scale[t].exp()))


def observed_chain_log_factors(x, loc, log_scale, K: int):
    """frontier.chain_log_factors for the observed chain: ``(f1, F, g)`` for ``tree_contract``."""
    q = Normal(loc, log_scale.exp())
    z = q.rsample((K,))  # (K, T)
    log_q = (q.log_prob(z) + math.log(K)).T  # (T, K), with the 1/K
    z = z.T
    observed = Normal(z, 1.0).log_prob(x[:, None])  # (T, K)
    f1 = Normal(0.0, STEP_SCALE).log_prob(z[0]) - log_q[0] + observed[0]
    F = (
        Normal(z[:-1, :, None], STEP_SCALE).log_prob(z[1:, None, :])
        - log_q[1:, None, :]
        + observed[1:, None, :]
    )
    return f1, F, torch.zeros_like(f1)


class Chain(NamedTuple):
    """One chain model: vectorised, unrolled and hand-written, and its arguments."""

    title: str
    model: Callable
    guide: Callable
    unrolled_model: Callable
    unrolled_guide: Callable
    args: tuple
    hand_factors: Callable[[], tuple]  # () -> (f1, F, g) of a fresh draw


def fig4_chain(N: int, K: int) -> Chain:
    x = torch.tensor(frontier.CHAIN_X)
    loc, log_scale = (t.clone().requires_grad_() for t in frontier.chain_init(N, x))
    return Chain(
        f"Fig. 4 chain N={N} K={K}",
        vectorized_chain_model,
        vectorized_chain_guide,
        frontier.chain_model,
        frontier.chain_guide,
        (x, N),
        lambda: frontier.chain_log_factors(x, loc, log_scale, K),
    )


def observed_chain(N: int, K: int) -> Chain:
    x = observed_chain_data(N)
    loc, log_scale = (t.clone().requires_grad_() for t in observed_chain_init(x))
    return Chain(
        f"observed chain T={N} K={K}",
        observed_chain_model,
        observed_chain_guide,
        observed_chain_unrolled,
        observed_chain_unrolled_guide,
        (x,),
        lambda: observed_chain_log_factors(x, loc, log_scale, K),
    )


def chain_case(chain: Chain, K: int, compiled: bool, unrolled: bool) -> frontier.Case:
    case = frontier.Case(chain.title)
    model, guide, args = chain.model, chain.guide, chain.args
    case.steps["vectorized_markov, eager"] = frontier._pyro_step(
        TMC_ELBO(num_samples=K, max_plate_nesting=1), model, guide, *args
    )
    modes = ("graph", "inductor") if compiled else ("graph",)
    for mode in modes:
        loss = TMC_ELBO(num_samples=K, max_plate_nesting=1, compile=mode)
        label = f"{mode!r}, estimate only"  # differentiable_loss: guide and model eager
        frontier.add_program_step(case, mode, "cpu", loss, model, guide, *args, label=label)
        loss = TMC_ELBO(num_samples=K, max_plate_nesting=1, compile=mode)
        add_whole_step(case, mode, loss, model, guide, *args)
    if unrolled:
        case.steps["pyro.markov, eager"] = frontier._pyro_step(
            TMC_ELBO(num_samples=K, max_plate_nesting=0), chain.unrolled_model, chain.unrolled_guide, *args
        )

    def tree():
        return frontier.tree_contract(*chain.hand_factors())

    case.steps[TREE] = frontier._backward_step(tree)
    case.careful.append(TREE)
    if compiled:
        torch._dynamo.reset()
        compiled_tree = torch.compile(tree)
        start = time.perf_counter()
        frontier._backward_step(compiled_tree)()
        case.compile_seconds[f"{TREE}, torch.compile"] = f"{time.perf_counter() - start:.1f}"
        case.steps[f"{TREE}, torch.compile"] = frontier._backward_step(compiled_tree)
        # the exact tree (float64, then the underflowed entries by max-plus), compiled: what
        # pyro_tmc computes, by hand
        capacities = frontier.fitted_capacities(chain.hand_factors)

        def exact_tree():
            return frontier.static_exact_tree_contract(*chain.hand_factors(), capacities)

        frontier.add_compiled_handwritten(case, f"{TREE}, exact, torch.compile", exact_tree, "cpu")
        case.careful.remove(f"{TREE}, exact, torch.compile")  # the last column stays "x the eager tree"
    _check_same_estimate(case, chain, K)
    return case


def add_whole_step(case: frontier.Case, mode: str, loss, model, guide, *args) -> None:
    """frontier.add_captured_step on the CPU: eager step, capture and first (compiling) replay timed apart."""
    frontier.add_captured_step(case, mode, "cpu", loss, model, guide, *args)


def _check_same_estimate(case: frontier.Case, chain: Chain, K: int, draws: int = 20) -> None:
    """The three estimates agree in distribution: -log P_TMC over fresh draws, at the guide's init."""
    vectorized = TMC_ELBO(num_samples=K, max_plate_nesting=1)
    unrolled = TMC_ELBO(num_samples=K, max_plate_nesting=0)
    values = {}
    for name, loss, model, guide in (
        ("vectorized_markov", vectorized, chain.model, chain.guide),
        ("pyro.markov", unrolled, chain.unrolled_model, chain.unrolled_guide),
    ):
        runs = []
        for _ in range(draws):
            pyro.get_param_store().clear()
            runs.append(loss.loss(model, guide, *chain.args))
        values[name] = torch.tensor(runs)
    with torch.no_grad():
        values["hand-written"] = torch.stack(
            [frontier.tree_contract(*chain.hand_factors()) for _ in range(draws)]
        )
    case.notes.append(
        f"{case.title}: -log P_TMC over {draws} draws (mean +- sd): "
        + ", ".join(f"{name} {v.mean():.3f} +- {v.std():.3f}" for name, v in values.items())
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="N=20, K=8, 2 repeats, no compile")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="chain lengths N (K=32)")
    parser.add_argument("--chains", nargs="+", default=["fig4", "observed"], choices=("fig4", "observed"))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-unrolled", action="store_true", help="leave out the pyro.markov row")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    sizes = [(20, 8)] if args.quick else [(N, 32) for N in args.sizes]
    repeats = 2 if args.quick else args.repeats
    compiled = not (args.quick or args.no_compile)
    if compiled:
        frontier.warm_compiler("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {frontier.device_name('cpu')}")
    print("| case | method | ms / step | compile s | x tree |")
    print("|---|---|---|---|---|")
    notes = []
    makers = {"fig4": fig4_chain, "observed": observed_chain}
    for name in args.chains:
        for N, K in sizes:
            case = chain_case(makers[name](N, K), K, compiled, unrolled=not args.no_unrolled)
            frontier.run_case(case, repeats, "cpu")
            notes += case.notes + [f"{row}: {why}" for row, why in case.failed.items()]
    print("\n".join(notes))


if __name__ == "__main__":
    main()
