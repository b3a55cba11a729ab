"""pyro_tmc against what a careful engineer writes by hand, side by side in one process.

    python benchmarks/frontier.py --quick                # a smoke run (CPU, < 1 minute)
    python benchmarks/frontier.py --out benchmarks/results/frontier_cpu.md     # CPU, 1 thread
    python benchmarks/frontier.py --device cuda --out frontier_cuda.md        # see gpu_check.sh

The current results: ``benchmarks/results/frontier_cpu.md`` (CPU) and
``benchmarks/results/cuda_<card>/`` (GPUs); ``docs/performance.md`` reads them.

Cases (each timed as one forward + backward step):

1. the paper's toy model (``models.toy_model`` / ``models.toy_guide``), N=128 K=128 and
   N=1024 K=32: ``pyro_tmc.TMC_ELBO``; the eager hand-written TMC
   (``models.handwritten_tmc_loss``); the same function under ``torch.compile``
   (compiled per case with cold caches; the compile time, i.e. the first call, has its
   own column);
2. the Gaussian random-walk chain of the paper's Fig. 4 written with ``pyro.markov``
   (``z_i ~ N(z_{i-1}, 1/N)``, ``x ~ N(z_N, 1)``, a factorised guide with a learnable
   loc / log-scale per step, as ``tests/common/models.py``), N=100 and N=1000, K=32:
   ``pyro_tmc.TMC_ELBO``; a hand-written sequential TMC (a forward loop of K x K
   log-matmul-exp messages); a hand-written log-depth contraction (a balanced tree of
   batched log-matmul-exp over the stacked (N-1, K, K) factors), in float32 as written
   (it loses the entries that underflow), and exact (float64, then the underflowed entries
   by max-plus), eagerly and under ``torch.compile`` (static shapes: each level repairs up to
   a capacity fitted, as pyro_tmc fits its own, to the entries three draws needed);
3. the toy model at N=128 K=8, where per-step overhead dominates;
4. an HMM with enumerated states (16 sequences in a plate, T=50 and 200, AutoDelta globals):
   ``pyro_tmc.TMC_ELBO`` against Pyro's own ``TraceEnum_ELBO`` on the same model and guide;
5. (``first_step``) the enumerated-state HMM of ``first_step.py`` (4 states, 3-dim Gaussian
   emissions, an empty guide, T=200 and 1000) under ``compile="inductor"``, beside NumPyro's
   ``scan`` where NumPyro is installed (the ``peers`` extra): each in a child process with cold
   caches, its compile column the first 8 steps, its phases in the notes.

pyro_tmc is timed eagerly and with ``TMC_ELBO(compile="graph")`` (the estimate traced once
into a graph of tensor operations and replayed) and, where torch.compile is on,
``compile="inductor"`` (that graph compiled: fused kernels); their first call, which
traces and compiles, is in the compile column.

Timings are medians of ``--repeats`` interleaved rounds (every method once per round)
after warm-up, with ``torch.cuda.synchronize`` around each step on CUDA. The last
column is each method's time over the fastest hand-written method of its case, so the
pyro_tmc row gives pyro_tmc's overhead over a careful engineer.
"""

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch
from torch.distributions import Normal

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

from pyro_tmc import TMC_ELBO  # noqa: E402

PYRO_TMC = "pyro_tmc TMC_ELBO"
#: relative tolerance between the sequential and the tree contraction on the same particles
TREE_RTOL = 1e-4
#: the chain's observation, as tests/common/models.py's CHAIN_X
CHAIN_X = 1.0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pyro_step(loss, model, guide, *args) -> Callable[[], torch.Tensor]:
    """As in run.py: a fresh param store per step, so every step starts from the guide's init."""

    def step():
        pyro.get_param_store().clear()
        value = loss.differentiable_loss(model, guide, *args)
        value.backward()
        return value

    return step


def _backward_step(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def step():
        value = loss_fn()
        value.backward()
        return value

    return step


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# -- the chain of the paper's Fig. 4 (as tests/common/models.py), with a learnable guide ---


def chain_model(x, N):
    z = x.new_zeros(())
    scale = math.sqrt(1.0 / N)
    for i in pyro.markov(range(1, N + 1)):
        z = pyro.sample(f"z_{i}", dist.Normal(z, scale))
    pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def chain_init(N, x):
    """The guide's initial value: Q(z_i) = N(0, i/N), the prior marginal of z_i."""
    loc = x.new_zeros(N)
    log_scale = 0.5 * torch.log(torch.arange(1, N + 1, dtype=x.dtype, device=x.device) / N)
    return loc, log_scale


def chain_guide(x, N):
    """Factorised: Q(z_i) = N(loc_i, exp(log_scale_i)^2), learnable per step."""
    loc = pyro.param("chain_loc", lambda: chain_init(N, x)[0])
    log_scale = pyro.param("chain_log_scale", lambda: chain_init(N, x)[1])
    for i in pyro.markov(range(1, N + 1)):
        pyro.sample(f"z_{i}", dist.Normal(loc[i - 1], log_scale[i - 1].exp()))


def chain_log_factors(x, loc, log_scale, K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K particles per step from the guide and the TMC log-factors of the chain.

    Returns ``f1`` (K,): log p(z_1) - log q(z_1) - log K; ``F`` (N-1, K, K) with
    ``F[t, j, k] = log p(z_{t+2}^k | z_{t+1}^j) - log q(z_{t+2}^k) - log K``; and ``g`` (K,):
    log p(x | z_N). ``-log P_TMC = -logsumexp(f1 @ F[0] @ ... @ F[N-2] @ g)`` in the
    (logsumexp, +) semiring.
    """
    N = loc.shape[0]
    scale = math.sqrt(1.0 / N)
    q = Normal(loc, log_scale.exp())
    z = q.rsample((K,))  # (K, N)
    log_q = (q.log_prob(z) + math.log(K)).T  # (N, K), with the 1/K
    z = z.T
    f1 = Normal(0.0, scale).log_prob(z[0]) - log_q[0]
    F = Normal(z[:-1, :, None], scale).log_prob(z[1:, None, :]) - log_q[1:, None, :]
    g = Normal(z[-1], 1.0).log_prob(x)
    return f1, F, g


def sequential_contract(f1, F, g) -> torch.Tensor:
    """-log P_TMC by a forward loop of messages, one K x K log-matmul-exp per step."""
    alpha = f1
    for t in range(F.shape[0]):
        alpha = torch.logsumexp(alpha[:, None] + F[t], 0)
    return -torch.logsumexp(alpha + g, 0)


def log_matmul_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) @ exp(b))`` for batches of matrices, by a matmul.

    Rows of ``a`` and columns of ``b`` are shifted by their (detached) maxima before the
    exp; an all -inf row / column gets shift 0 and yields -inf, not NaN; a sum that is 0
    gives -inf with a zero (not NaN) gradient.
    """
    shift_a = a.detach().amax(-1, keepdim=True)
    shift_b = b.detach().amax(-2, keepdim=True)
    shift_a = torch.where(torch.isfinite(shift_a), shift_a, torch.zeros_like(shift_a))
    shift_b = torch.where(torch.isfinite(shift_b), shift_b, torch.zeros_like(shift_b))
    s = torch.matmul((a - shift_a).exp(), (b - shift_b).exp())
    positive = s > 0
    log_s = torch.where(
        positive, torch.where(positive, s, torch.ones_like(s)).log(), torch.full_like(s, -math.inf)
    )
    return log_s + shift_a + shift_b


def _float64_product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    :func:`log_matmul_exp` in float64, in ``a``'s dtype, and where its entries are not exact:
    their shifted sums are below float64's floor for K terms (each lost term < 1e-304).
    """
    shift_a = a.detach().amax(-1, keepdim=True).double()
    shift_b = b.detach().amax(-2, keepdim=True).double()
    # clamped at exp(-700): each term off by < 1e-304, and exp off its slow path for tiny results
    s = torch.matmul(
        (a.double() - shift_a).clamp(min=-700).exp(), (b.double() - shift_b).clamp(min=-700).exp()
    )
    return (s.clamp(min=1e-290).log() + shift_a + shift_b).to(a.dtype), s < 1e-290


def exact_log_matmul_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """
    :func:`log_matmul_exp` made exact, as a careful engineer would: the product in
    float64, then each entry whose shifted sum still underflows (Fig. 4's chain at the
    guide's initial values: 9% of the first tree level's entries) by max-plus, alone.
    """
    result, low = _float64_product(a, b)
    bad = low.nonzero(as_tuple=True)
    if not bad[0].numel():
        return result
    batch, i, k = bad
    exact = torch.logsumexp(_rows(a, batch, i) + _rows(b.transpose(-1, -2), batch, k), -1)
    return result.index_put(bad, exact)


def _rows(matrices: torch.Tensor, batch: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``matrices[batch, row, :]`` by ``index_select`` (on the CPU, far faster than advanced indexing)."""
    flat = batch * matrices.size(-2) + row
    return matrices.reshape(-1, matrices.size(-1)).index_select(0, flat)


def exact_tree_contract(f1, F, g) -> torch.Tensor:
    """:func:`tree_contract` with :func:`exact_log_matmul_exp`: the same value, with no entry lost."""
    while F.shape[0] > 1:
        n = F.shape[0]
        paired = exact_log_matmul_exp(F[0 : n - 1 : 2], F[1:n:2])
        F = torch.cat([paired, F[n - 1 :]], 0) if n % 2 else paired
    if F.shape[0] == 0:
        return -torch.logsumexp(f1 + g, 0)
    return -torch.logsumexp((f1[:, None] + F[0] + g[None, :]).reshape(-1), 0)


def static_exact_log_matmul_exp(a: torch.Tensor, b: torch.Tensor, capacity: int) -> torch.Tensor:
    """
    :func:`exact_log_matmul_exp` with static shapes, for ``torch.compile``: up to ``capacity``
    underflowed entries (``nonzero_static``; unused slots land on a dropped extra slot) are
    recomputed by max-plus every call. Beyond ``capacity`` entries it is wrong: a floor for
    timing only, sized by :func:`repair_counts`.
    """
    result, low = _float64_product(a, b)
    coordinates = torch.nonzero_static(low, size=capacity, fill_value=-1)
    batch, i, k = coordinates.clamp(min=0).unbind(-1)
    rows, columns = result.shape[-2:]
    flat = torch.where(coordinates[:, 0] >= 0, (batch * rows + i) * columns + k, result.numel())
    # advanced indexing, not _rows: compiled by inductor, it makes the faster step
    exact = torch.logsumexp(a[batch, i, :] + b.transpose(-1, -2)[batch, k, :], -1)
    padded = torch.cat([result.reshape(-1), result.new_zeros(1)])
    return padded.index_put((flat,), exact)[: result.numel()].reshape(result.shape)


def repair_counts(f1, F, g) -> list[int]:
    """How many entries :func:`exact_log_matmul_exp` repairs at each level of the tree, on one draw."""
    counts = []
    while F.shape[0] > 1:
        n = F.shape[0]
        a, b = F[0 : n - 1 : 2], F[1:n:2]
        counts.append(int(_float64_product(a, b)[1].sum()))
        paired = exact_log_matmul_exp(a, b)
        F = torch.cat([paired, F[n - 1 :]], 0) if n % 2 else paired
    return counts


def fitted_capacities(draw: Callable[[], tuple], draws: int = 3) -> list[int]:
    """
    Each tree level's repair capacity for :func:`static_exact_tree_contract`, sized as pyro_tmc
    sizes its own (1.5x the most entries ``draws`` draws needed, plus 64): the same work timed.
    ``draw()`` gives a fresh draw's ``(f1, F, g)``.
    """
    with torch.no_grad():
        needs = [repair_counts(*draw()) for _ in range(draws)]
    return [math.ceil(1.5 * max(level)) + 64 for level in zip(*needs)]


def static_exact_tree_contract(f1, F, g, capacities: list[int]) -> torch.Tensor:
    """:func:`exact_tree_contract` by :func:`static_exact_log_matmul_exp`, one capacity per level."""
    for capacity in capacities:
        n = F.shape[0]
        paired = static_exact_log_matmul_exp(F[0 : n - 1 : 2], F[1:n:2], capacity)
        F = torch.cat([paired, F[n - 1 :]], 0) if n % 2 else paired
    if F.shape[0] == 0:
        return -torch.logsumexp(f1 + g, 0)
    return -torch.logsumexp((f1[:, None] + F[0] + g[None, :]).reshape(-1), 0)


def tree_contract(f1, F, g) -> torch.Tensor:
    """-log P_TMC by a balanced tree of batched log-matmul-exp: log2(N) levels."""
    while F.shape[0] > 1:
        n = F.shape[0]
        paired = log_matmul_exp(F[0 : n - 1 : 2], F[1:n:2])  # (n // 2, K, K), order kept
        F = torch.cat([paired, F[n - 1 :]], 0) if n % 2 else paired
    if F.shape[0] == 0:  # N = 1
        return -torch.logsumexp(f1 + g, 0)
    return -torch.logsumexp((f1[:, None] + F[0] + g[None, :]).reshape(-1), 0)


# -- cases ---------------------------------------------------------------------------


class Case:
    def __init__(self, title: str):
        self.title = title
        self.steps: dict[str, Callable[[], torch.Tensor]] = {}
        self.careful: list[str] = []  # the hand-written methods
        self.compile_seconds: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.notes: list[str] = []
        #: read after the timing: what each captured step did while it was timed
        self.reports: list[Callable[[], str]] = []


#: pyro_tmc's own cached programs (TMC_ELBO(compile=...)), timed beside its eager path
PROGRAM_MODES = ("graph", "inductor")


def _add_compiled_row(case: "Case", name: str, mode: str, device: str, step, first_calls: int) -> None:
    """
    Time ``step``'s first ``first_calls`` calls (tracing, capturing, compiling) into the compile
    column; a fallback to eager (pyro_tmc's "could not ..." warning) is a failed row instead.
    """
    if mode == "inductor":
        torch._dynamo.reset()  # a fresh compile per case, as for the hand-written one
    _sync(device)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            for _ in range(first_calls):
                step()
        except Exception as e:  # report and go on (e.g. a CUDA graph that cannot be captured)
            reason = " ".join(str(e).split()).replace("|", "/")[:160] or type(e).__name__
            case.failed[name] = f"failed: {type(e).__name__}: {reason}"
            return
    _sync(device)
    messages = [str(w.message) for w in caught]
    # the estimate program's, or a step that runs eagerly (pyro_tmc.compile.fallback.EAGER)
    fallbacks = [m for m in messages if "pyro_tmc could not" in m and "runs eagerly instead" in m]
    if fallbacks:
        case.failed[name] = "fell back to eager: " + fallbacks[0][:160].replace("|", "/")
        return
    # a captured step that replays uncompiled or runs eagerly says so ("pyro_tmc..."): its row
    # is timed as it runs, and the note says why it is not compiled
    case.notes += [f"{case.title}, {name}: {m[:300]}" for m in messages if m.startswith("pyro_tmc")]
    case.compile_seconds[name] = f"{time.perf_counter() - start:.1f}"
    case.steps[name] = step


def add_program_step(case: "Case", mode: str, device: str, loss, model, guide, *args, label=None) -> None:
    """A row for ``TMC_ELBO(compile=mode)``'s estimate program; its first call is the compile column."""
    name = f"{PYRO_TMC} compile={label or repr(mode)}"
    _add_compiled_row(case, name, mode, device, _pyro_step(loss, model, guide, *args), first_calls=1)


def add_captured_step(case: "Case", mode: str, device: str, loss, model, guide, *args, label=None) -> None:
    """
    A row for the whole step captured (``loss_and_grads`` under ``TMC_ELBO(compile=mode)``,
    :mod:`pyro_tmc.compile.captured_step`): guide, model, estimate and gradients in one graph. The
    parameters persist between steps (a replay does not re-run ``pyro.param``'s init); its
    first three calls are the compile column: an eager step, the capture, and the first
    replay, where ``torch.compile`` compiles the graph (it compiles lazily).
    """
    pyro.get_param_store().clear()

    def step():
        value = loss.loss_and_grads(model, guide, *args)
        for p in pyro.get_param_store().values():
            p.unconstrained().grad = None
        return torch.tensor(value)  # loss_and_grads returns a float

    name = f"{PYRO_TMC} compile={label or repr(mode)}, whole step"
    _add_compiled_row(case, name, mode, device, step, first_calls=3)
    if name in case.steps:
        case.reports.append(lambda: f"{case.title}, {name}: {_what_the_step_did(loss.step_program)}")


def _what_the_step_did(program) -> str:
    """
    A captured step's counts after its row was timed: a row slower than expected may have
    run eagerly (an uncompiled replay slower than the eager step gives way to it) or had
    replays redone eagerly (a stiff chain's products past the graph's repair capacity).
    """
    steps = list(program._steps.values())
    redone = sum(captured.redone for captured in steps)
    attempts = sum(captured.attempts for captured in steps)
    eager = sum(captured.program is None for captured in steps)
    return (
        f"{program.captures} captures, {program.replays} replays kept, {redone} of {attempts} "
        f"replays redone eagerly, {eager} of {len(steps)} captured keys running eagerly"
    )


def toy_case(num_data: int, num_samples: int, device: str, compiled: bool) -> Case:
    case = Case(f"toy N={num_data} K={num_samples}")
    x = torch.randn(num_data, device=device)
    loc = torch.zeros(2, device=device, requires_grad=True)
    log_scale = torch.tensor([0.0, 0.5 * math.log(2.0)], device=device, requires_grad=True)
    case.steps[PYRO_TMC] = _pyro_step(
        TMC_ELBO(num_samples=num_samples, max_plate_nesting=1), models.toy_model, models.toy_guide, x
    )
    for mode in PROGRAM_MODES if compiled else PROGRAM_MODES[:1]:
        add_program_step(
            case,
            mode,
            device,
            TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, compile=mode),
            models.toy_model,
            models.toy_guide,
            x,
        )
    for mode in PROGRAM_MODES if compiled else PROGRAM_MODES[:1]:
        add_captured_step(
            case,
            mode,
            device,
            TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, compile=mode),
            models.toy_model,
            models.toy_guide,
            x,
        )
    if compiled and device == "cuda":  # the whole step in one CUDA graph: one launch per step
        add_captured_step(
            case,
            "inductor",
            device,
            TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, **CUDA_GRAPHS),
            models.toy_model,
            models.toy_guide,
            x,
            label=CUDA_GRAPHS_LABEL,
        )
    if compiled and device == "cuda":  # CUDA graphs: one launch for the estimate's kernels
        add_program_step(
            case,
            "inductor",
            device,
            TMC_ELBO(
                num_samples=num_samples,
                max_plate_nesting=1,
                compile="inductor",
                compile_options={"mode": "reduce-overhead"},
            ),
            models.toy_model,
            models.toy_guide,
            x,
            label="inductor, mode='reduce-overhead'",
        )
    case.steps["hand-written TMC (eager)"] = _backward_step(
        lambda: models.handwritten_tmc_loss(x, loc, log_scale, num_samples)
    )
    case.careful.append("hand-written TMC (eager)")
    if compiled:
        add_compiled_handwritten(
            case,
            "hand-written TMC (torch.compile)",
            lambda: models.handwritten_tmc_loss(x, loc, log_scale, num_samples),
            device,
        )
    values = {name: statistics.fmean(step().item() for _ in range(3)) for name, step in case.steps.items()}
    case.notes.append(
        f"{case.title}: -log P_TMC (mean of 3 draws each): "
        + ", ".join(f"{name} {v:.3f}" for name, v in values.items())
    )
    return case


# -- an HMM with enumerated hidden states, against Pyro's own TraceEnum_ELBO ------------


@config_enumerate
def hmm_model(observations, num_states=3, vocab_size=4):
    """Symbol sequences (num_sequences, T) in a plate; states enumerated; Dirichlet globals (MAP)."""
    init = pyro.sample("init", dist.Dirichlet(observations.new_ones(num_states, dtype=torch.float)))
    trans = pyro.sample(
        "trans", dist.Dirichlet(0.5 + 1.5 * torch.eye(num_states, device=init.device)).to_event(1)
    )
    emit = pyro.sample(
        "emit", dist.Dirichlet(0.7 * torch.ones(num_states, vocab_size, device=init.device)).to_event(1)
    )
    with pyro.plate("sequences", observations.shape[0], dim=-1):
        x = None
        for t in pyro.markov(range(observations.shape[1])):
            x = pyro.sample(f"x_{t}", dist.Categorical(init if x is None else trans[x]))
            pyro.sample(f"y_{t}", dist.Categorical(emit[x]), obs=observations[:, t])


def hmm_case(length: int, device: str) -> Case:
    """pyro_tmc against TraceEnum_ELBO on the same model and AutoDelta guide: both sum the states exactly."""
    case = Case(f"HMM T={length}, 16 sequences, 3 enumerated states")
    pyro.clear_param_store()
    observations = torch.randint(4, (16, length), device=device)
    guide = AutoDelta(poutine.block(hmm_model, expose=["init", "trans", "emit"]))
    enum = TraceEnum_ELBO(max_plate_nesting=1)
    case.steps[PYRO_TMC] = _pyro_step(
        TMC_ELBO(num_samples=4, max_plate_nesting=1), hmm_model, guide, observations
    )
    for mode in PROGRAM_MODES:
        add_captured_step(
            case,
            mode,
            device,
            TMC_ELBO(num_samples=4, max_plate_nesting=1, compile=mode),
            hmm_model,
            guide,
            observations,
        )
    pyro.clear_param_store()
    case.steps["Pyro TraceEnum_ELBO"] = lambda: enum.loss_and_grads(hmm_model, guide, observations)
    case.careful.append("Pyro TraceEnum_ELBO")
    return case


#: the longest chain whose rolled whole step is also compiled by inductor here: at N=1000 the rolled
#: step has about 2,340 operations (below ``max_inductor_nodes``), and its compile takes about 80 s
CHAIN_INDUCTOR_MAX = 1000

#: a whole step compiled by inductor and replayed as a CUDA graph
CUDA_GRAPHS = {"compile": "inductor", "compile_options": {"mode": "reduce-overhead"}}
CUDA_GRAPHS_LABEL = "inductor, mode='reduce-overhead'"


def add_compiled_handwritten(case: Case, name: str, loss_fn: Callable[[], torch.Tensor], device: str) -> None:
    """A hand-written step under ``torch.compile`` (fresh per case); its first call is the compile column."""
    case.careful.append(name)
    try:
        torch._dynamo.reset()  # a fresh compile per case, specialised to its shapes
        step = _backward_step(torch.compile(loss_fn, dynamic=False))
        _sync(device)
        start = time.perf_counter()
        step()  # compiles forward and backward
        _sync(device)
        case.compile_seconds[name] = f"{time.perf_counter() - start:.1f}"
        case.steps[name] = step
    except Exception as e:  # report and go on
        reason = " ".join(str(e).split()).replace("|", "/")[:160] or type(e).__name__
        case.failed[name] = f"compile failed: {type(e).__name__}: {reason}"


def add_chain_rows(case: Case, device: str, x: torch.Tensor, N: int, K: int, graph_rows: bool) -> None:
    """pyro_tmc's captured rows of a chain case: uncompiled (``graph_rows``) and under inductor."""

    def add_row(add, mode: str, label=None, **compile_keywords) -> None:
        loss = TMC_ELBO(num_samples=K, max_plate_nesting=0, **compile_keywords)
        add(case, mode, device, loss, chain_model, chain_guide, x, N, label=label)

    if graph_rows:  # the uncompiled captures: --lean leaves them out
        for add in (add_program_step, add_captured_step):
            add_row(add, "graph", compile="graph")
    if N <= CHAIN_INDUCTOR_MAX:  # the rolled step is small enough for inductor to compile
        # on a GPU, in one CUDA graph (a launch-bound step's floor), in place of the plain
        # inductor row: each compile of the N=1000 step takes minutes
        if device == "cuda":
            add_row(add_captured_step, "inductor", label=CUDA_GRAPHS_LABEL, **CUDA_GRAPHS)
        if device != "cuda" or any(CUDA_GRAPHS_LABEL in name for name in case.failed):  # or without
            add_row(add_captured_step, "inductor", compile="inductor")


def chain_case(num_steps: int, num_samples: int, device: str, graph_rows: bool = True) -> Case:
    N, K = num_steps, num_samples
    case = Case(f"chain N={N} K={K}")
    x = torch.tensor(CHAIN_X, device=device)
    loc, log_scale = (t.clone().requires_grad_() for t in chain_init(N, x))

    def sequential():
        return sequential_contract(*chain_log_factors(x, loc, log_scale, K))

    def tree():
        return tree_contract(*chain_log_factors(x, loc, log_scale, K))

    def exact_tree():  # the tree above, with its underflowed entries repaired: what pyro_tmc computes
        return exact_tree_contract(*chain_log_factors(x, loc, log_scale, K))

    case.steps[PYRO_TMC] = _pyro_step(
        TMC_ELBO(num_samples=K, max_plate_nesting=0), chain_model, chain_guide, x, N
    )
    add_chain_rows(case, device, x, N, K, graph_rows)
    case.steps["hand-written sequential"] = _backward_step(sequential)
    case.steps["hand-written log-depth tree"] = _backward_step(tree)
    case.steps["hand-written log-depth tree, exact"] = _backward_step(exact_tree)
    case.careful += [
        "hand-written sequential",
        "hand-written log-depth tree",
        "hand-written log-depth tree, exact",
    ]
    add_compiled_handwritten(case, "hand-written log-depth tree (torch.compile)", tree, device)  # the floor

    capacities = fitted_capacities(lambda: chain_log_factors(x, loc, log_scale, K))

    def static_exact_tree():
        return static_exact_tree_contract(*chain_log_factors(x, loc, log_scale, K), capacities)

    add_compiled_handwritten(
        case, "hand-written log-depth tree, exact (torch.compile)", static_exact_tree, device
    )
    case.notes.append(f"{case.title}: the compiled exact tree's repair capacities per level: {capacities}")

    # the two hand-written contractions on the same particles: same value and gradient
    f1, F, g = chain_log_factors(x, loc, log_scale, K)
    seq = sequential_contract(f1, F, g)
    seq_grads = torch.autograd.grad(seq, (loc, log_scale), retain_graph=True)
    tr = tree_contract(f1, F, g)
    with torch.no_grad():
        static = static_exact_tree_contract(f1, F, g, capacities).item()
    assert abs(static - seq.item()) <= TREE_RTOL * max(abs(seq.item()), 1.0), (static, seq.item())
    tr_grads = torch.autograd.grad(tr, (loc, log_scale))
    diff = abs(seq.item() - tr.item())
    grad_diff = max((a - b).abs().max().item() for a, b in zip(seq_grads, tr_grads))
    grad_scale = max(a.abs().max().item() for a in seq_grads)
    case.notes.append(
        f"{case.title}: sequential {seq.item():.6f} vs tree {tr.item():.6f} on the same particles: "
        f"|diff| {diff:.3g} (rel {diff / max(abs(seq.item()), 1e-30):.3g}); "
        f"max |grad diff| {grad_diff:.3g} (max |grad| {grad_scale:.3g})"
    )
    assert math.isfinite(seq.item()) and diff <= TREE_RTOL * max(abs(seq.item()), 1.0), case.notes[-1]
    pyro_values = [case.steps[PYRO_TMC]().item() for _ in range(3)]
    hand_values = [sequential().item() for _ in range(3)]
    case.notes.append(
        f"{case.title}: -log P_TMC on own draws (3 each): {PYRO_TMC} "
        + " ".join(f"{v:.2f}" for v in pyro_values)
        + "; hand-written "
        + " ".join(f"{v:.2f}" for v in hand_values)
    )
    return case


# -- the enumerated-state HMM beside NumPyro's scan: benchmarks/first_step.py ----------


def first_step_rows(cases: tuple[str, ...], device: str) -> tuple[list[str], list[str]]:
    """
    The rows of ``first_step.py`` (each case and mode in a child process with cold caches), in
    this table's form: the compile column is the first 8 steps (NumPyro's: its first, jit-compiled,
    call), the last column pyro_tmc's time over NumPyro's ``scan`` (the careful reference here;
    ``nan`` without NumPyro). CPU only: the children run on the CPU.
    """
    import first_step

    if device != "cpu":
        return [], ["first_step cases: CPU only, left out"]
    modes = ["inductor"] + (["numpyro"] if first_step.numpyro_available() else [])
    notes = [] if "numpyro" in modes else ["NumPyro rows left out: numpyro, jax or funsor is not importable"]
    rows = []
    for case in cases:
        results = {mode: first_step.run_child(case, mode, warm=False, timeout=1800) for mode in modes}
        reference = results.get("numpyro", {}).get("ms_per_step", float("nan"))
        for mode, result in results.items():
            name = first_step.label(mode)
            if "error" in result:
                rows.append(f"| {case} | {name} | failed: {result['error']} | - | - |")
                continue
            ms, first = result["ms_per_step"], result["first_steps_s"]
            rows.append(f"| {case} | {name} | {ms:.2f} | {first:.1f} | {ms / reference:.2f} |")
            if result.get("phases_s"):
                phases = ", ".join(f"{k} {v:.1f} s" for k, v in result["phases_s"].items())
                notes.append(f"{case}, {name}: first steps' phases: {phases}; loss {result['loss']:.3f}")
    print("\n".join(rows), flush=True)
    return rows, notes


# -- timing and the table --------------------------------------------------------------


def median_seconds(
    steps: dict[str, Callable[[], torch.Tensor]], repeats: int, device: str, warmup: int = 2
) -> dict[str, float]:
    """Interleaved timing: each round runs every method once, after ``warmup`` rounds."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(warmup):
        for step in steps.values():
            step()
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_case(case: Case, repeats: int, device: str) -> list[str]:
    seconds = median_seconds(case.steps, repeats, device)
    case.notes += [report() for report in case.reports]
    best = min((seconds[name] for name in case.careful if name in seconds), default=float("nan"))
    rows = []
    for name in list(case.steps) + list(case.failed):
        if name in case.failed:
            rows.append(f"| {case.title} | {name} | {case.failed[name]} | - | - |")
            continue
        ratio = seconds[name] / best
        compile_seconds = case.compile_seconds.get(name, "-")
        rows.append(
            f"| {case.title} | {name} | {1e3 * seconds[name]:.2f} | {compile_seconds} | {ratio:.2f} |"
        )
    print("\n".join(rows), flush=True)
    return rows


def warm_compiler(device: str) -> float:
    """Import and start torch.compile's machinery once, on a throwaway function."""
    start = time.perf_counter()
    try:
        t = torch.ones(3, device=device, requires_grad=True)
        torch.compile(lambda a: (a * 2).sum())(t).backward()
        _sync(device)
    except Exception:
        pass  # the cases report the failure
    torch._dynamo.reset()
    return time.perf_counter() - start


def case_sizes(quick: bool, skip_long: bool) -> tuple:
    """The toy's (N, K)s, the chain's lengths, the overhead toy's (N, K), the chain's K, the HMM's lengths."""
    if quick:
        toy_sizes, chain_sizes, overhead, chain_k, hmm_lengths = (
            ((16, 8), (64, 4)),
            (10, 20),
            (16, 4),
            8,
            (10,),
        )
    else:
        toy_sizes, chain_sizes = ((128, 128), (1024, 32)), (100, 1000)
        overhead, chain_k, hmm_lengths = (128, 8), 32, (50, 200)
    return toy_sizes, chain_sizes[:1] if skip_long else chain_sizes, overhead, chain_k, hmm_lengths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 10 on cuda, 5 on cpu)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default 1 on cpu, torch's own on cuda)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, 2 repeats")
    parser.add_argument("--skip-long", action="store_true", help="leave out the N=1000 chain")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    parser.add_argument(
        "--lean", action="store_true", help="leave out the chains' compile='graph' rows (a short GPU lease)"
    )
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this path")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated cases, run in this order: toy, chain (or one length: chain100, "
        "chain1000), overhead, hmm, first_step (the Gaussian HMM beside NumPyro; default: all)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    repeats = 2 if args.quick else (args.repeats or (10 if args.device == "cuda" else 5))
    # cold compile caches, so the compile column is a real compile on every run
    cache_dir = tempfile.mkdtemp(prefix="frontier_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    pyro.enable_validation(False)  # as in production training loops
    torch.manual_seed(0)

    toy_sizes, chain_sizes, overhead, chain_k, hmm_lengths = case_sizes(args.quick, args.skip_long)

    header = [
        f"device: {device_name(args.device)} ({args.device}); torch threads: {torch.get_num_threads()}; "
        f"torch {torch.__version__}; pyro {pyro.__version__}; "
        f"repeats: {repeats} (medians, interleaved, after 2 warm-up rounds)",
    ]
    compile_startup = None if args.no_compile else warm_compiler(args.device)
    if compile_startup is not None:
        header.append(f"torch.compile one-time start-up (not in the compile column): {compile_startup:.1f} s")
    table = [
        "| case | method | median ms (fwd+bwd) | compile s | x best hand-written |",
        "|---|---|---:|---:|---:|",
    ]
    print("\n".join(header + [""] + table), flush=True)

    notes: list[str] = []
    compiled = not args.no_compile
    graph_rows = not args.lean
    cases = {
        "toy": [lambda n=n, k=k: toy_case(n, k, args.device, compiled) for n, k in toy_sizes],
        "chain": [lambda n=n: chain_case(n, chain_k, args.device, graph_rows) for n in chain_sizes],
        # one chain length alone (chain100, chain1000), to order the cases of a short GPU lease
        **{f"chain{n}": [lambda n=n: chain_case(n, chain_k, args.device, graph_rows)] for n in chain_sizes},
        "overhead": [lambda: toy_case(overhead[0], overhead[1], args.device, compiled)],
        "hmm": [lambda n=n: hmm_case(n, args.device) for n in hmm_lengths],
    }
    # the enumerated-state HMM of benchmarks/first_step.py, beside NumPyro's scan (rows, not a Case)
    first_step_cases = ("hmm200",) if args.quick else ("hmm200", "hmm1000")
    # by default each case once: chain100 and chain1000 are the chain's two lengths, taken apart
    kinds = args.only.split(",") if args.only else ["toy", "chain", "overhead", "hmm", "first_step"]
    cases = [make for kind in kinds if kind != "first_step" for make in cases[kind]]
    first_steps = [first_step_cases] * (compiled and "first_step" in kinds)

    def write_table() -> None:  # after every case: a run stopped by its limit keeps what it finished
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(header + [""] + table + [""] + [f"- {note}" for note in notes]) + "\n")

    try:
        for make in cases:
            case = make()
            table += run_case(case, repeats, args.device)
            notes += case.notes
            write_table()
        for rows, more_notes in map(first_step_rows, first_steps, [args.device] * len(first_steps)):
            table += rows
            notes += more_notes
            write_table()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)

    print("\n" + "\n".join(f"- {note}" for note in notes), flush=True)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
