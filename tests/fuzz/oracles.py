"""Exact oracles for fuzz cases: each takes a :class:`~tests.fuzz.generator.Case` and returns
a list of :class:`Check` results (what was compared, expected, got, pass or not).

- :func:`enum_oracle`: ``TraceEnum_ELBO`` on models whose latents are all enumerated or
  Delta-guided: values, gradients and marginals, under each loss option.
- :func:`brute_force_oracle`: the average of p/q over all K^n particle combinations of one
  draw, listed by hand (values, marginal weights; IWAE's K joint samples).
- :func:`twin_oracle`: a subsampled or scaled plate against the full plate with the same
  datum in every element (the same objective).
- :func:`dtype_oracle`: float32 against float64 on identical particles.
- :func:`invariance_oracle`: the value on one draw does not depend on ``variance_reduction``,
  ``compile="graph"``, ``max_factor_bytes``, ``TMC_RWS``, where ``pyro.markov`` is written,
  ``num_particles`` (the mean of the draws), or an extra latent that nothing depends on.
- :func:`readout_oracle`: marginal weights sum to one; posterior draws are particles.
- :func:`unbiasedness_oracle`: ``E[P_TMC] = p(x)`` on linear-Gaussian models.
- :func:`budget_oracle`: under tiny ``max_factor_bytes`` (every latent's factor sliced), the
  value and gradients of the same draws without a budget.
- :func:`captured_oracle`: the captured whole step (``compile="graph"``, rolled) replayed
  from one RNG state equals the eager step: value and gradients. :func:`inductor_oracle`:
  the same compiled by inductor (opt-in: ``--oracle inductor``).
- :func:`chain_twin_oracle`: an AutoGuide's chain (``AutoNormal``, ``AutoDelta``) against the
  same guide written by hand, in ``pyro.markov`` and as a plain loop, with the AutoGuide's
  initial parameters: the same draws, so the same value and gradients.
"""

import contextlib
import itertools
import math
import random
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributions.dirichlet as torch_dirichlet
import torch.distributions.gamma as torch_gamma
import torch.distributions.lowrank_multivariate_normal as torch_lowrank_mvn
import torch.distributions.multivariate_normal as torch_mvn
import torch.distributions.normal as torch_normal
import torch.distributions.studentT as torch_student_t
import torch.distributions.utils as torch_distribution_utils

import pyro
from pyro import poutine
from pyro.infer import TraceEnum_ELBO

import pyro_tmc

from .generator import Case, Spec

#: relative tolerance of exact comparisons in float32 (values of order 1-100)
RTOL = 2e-4
#: the same for a step compiled by inductor, whose fused kernels round differently
INDUCTOR_RTOL = 1e-3
#: documented refusals of a whole case (API.md): "diagonal"/"permutation" with unequal K
REFUSAL_MESSAGES = ("needs every upstream latent to have the same number",)
#: errors that pyro_tmc documents as refusals (API.md): the option does not apply to the case
REFUSALS = (
    "stl",
    "dregs",
    "IWAE_ELBO",
    "reparameteris",
    "not reparam",
    "has_rsample",
    "equal K",
    "num_particles=1",
    "needs every upstream latent to have the same number",
)


@dataclass
class Check:
    """One comparison: ``oracle`` (its name), ``what`` was compared, ``expected`` / ``got``."""

    oracle: str
    what: str
    ok: bool
    expected: object = None
    got: object = None
    note: str = ""

    @property
    def refused(self) -> bool:
        """A documented refusal (API.md) reached by the check: the option does not apply, no failure."""
        return (
            not self.ok and isinstance(self.got, str) and any(word in self.got for word in REFUSAL_MESSAGES)
        )

    def line(self) -> str:
        return f"{self.oracle}/{self.what}: expected {self.expected} got {self.got} {self.note}".strip()


class NotApplicable(Exception):
    """The oracle does not judge this case."""


def close(a: float, b: float, rtol: float = RTOL) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * (1.0 + abs(b))


def _is_refusal(error: Exception) -> bool:
    return isinstance(error, (NotImplementedError, ValueError)) and any(
        word in str(error) for word in REFUSALS
    )


# --------------------------------------------------------------------------- #
# running a loss
# --------------------------------------------------------------------------- #


def tmc_elbo(spec: Spec, loss: str = "TMC_ELBO", **overrides):
    """The loss named ``loss`` with the case's K, proposal and plate nesting (overridable)."""
    kwargs = dict(num_samples=spec.options["num_samples"], max_plate_nesting=spec.max_plate_nesting)
    if loss != "IWAE_ELBO":
        kwargs["proposal"] = spec.options["proposal"]
    kwargs.update(overrides)
    return getattr(pyro_tmc, loss)(**kwargs)


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def fresh(case: Case, seed: int = 0):
    """
    ``(model, guide)`` built anew on an empty param store, then ``pyro.set_rng_seed(seed)``.
    An AutoGuide is set up first (its prototype run draws from the model), so that the draws
    after the seed do not depend on what the model samples at setup.
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model, guide = case.build()
    if case.spec.autoguide:
        with quiet(), poutine.block(), torch.no_grad():
            guide()
    pyro.set_rng_seed(seed)
    return model, guide


def run(case: Case, elbo, seed: int = 0, grads: bool = False, repeats: int = 1):
    """
    ``(loss, {param name: grad})``: a fresh param store, ``pyro.set_rng_seed(seed)``, the
    case built anew, then ``differentiable_loss`` (with gradients enabled, as SVI runs it).
    """
    model, guide = fresh(case, seed)
    with quiet():
        values = []
        for _ in range(repeats):
            try:
                loss = elbo.differentiable_loss(model, guide)
            except ValueError as error:  # TraceEnum_ELBO with no parameter in the loss refuses it
                if "cannot be differentiated" not in str(error) or repeats != 1:
                    raise
                model, guide = fresh(case, seed)  # the same draws (a subsample) again
                loss = torch.tensor(elbo.loss(model, guide))

            values.append(loss)
        loss = sum(values) / len(values)
        out = {}
        if grads:
            params = dict(pyro.get_param_store().named_parameters())
            if params and loss.requires_grad:
                got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
                out = {n: (torch.zeros_like(p) if g is None else g) for (n, p), g in zip(params.items(), got)}
    return loss.item(), out


# --------------------------------------------------------------------------- #
# TraceEnum_ELBO
# --------------------------------------------------------------------------- #

#: loss options checked against TraceEnum_ELBO (a case draws a few of them)
ENUM_OPTIONS = ("plain", "max_factor_bytes", "compile", "num_particles", "iwae", "rws", "stl", "dregs")


def _enum_twin(case: Case) -> Case:
    """The same pair with guide-enumerated sites enumerated in the model instead (same value)."""
    variant = case.variant()
    for site in variant.spec.sites:
        if site.treatment == "genum":
            site.treatment = "enum"
    return variant


def _option_elbo(spec: Spec, option: str):
    if option == "plain":
        return tmc_elbo(spec)
    if option == "max_factor_bytes":
        return tmc_elbo(spec, max_factor_bytes=spec.options["max_factor_bytes"])
    if option == "compile":
        return tmc_elbo(spec, compile="graph")
    if option == "num_particles":
        return tmc_elbo(spec, num_particles=2)
    if option == "iwae":
        return tmc_elbo(spec, "IWAE_ELBO")
    if option == "rws":
        return tmc_elbo(spec, "TMC_RWS")
    return tmc_elbo(spec, variance_reduction=option)


def enum_oracle(case: Case, options=None) -> list[Check]:
    """TMC equals TraceEnum_ELBO (value, gradients, marginals) when every latent is enumerated or a Delta."""
    spec = case.spec
    if spec.family not in ("enum",):
        raise NotApplicable
    oracle_case = _enum_twin(case)
    enum = TraceEnum_ELBO(max_plate_nesting=spec.max_plate_nesting)
    try:
        expected, expected_grads = run(oracle_case, enum, grads=True)
    except ValueError as error:
        if "common poutine.scale" in str(error):
            # an observation in a subsampled plate that depends on a global enumerated latent:
            # TraceEnum_ELBO cannot scale it (TMC can, on the log of each element's sum)
            raise NotApplicable from error
        raise
    checks = []
    rng = __import__("random").Random(spec.seed)
    choices = [
        o for o in ENUM_OPTIONS[1:] if o != "num_particles" or not any(p.subsample_size for p in spec.plates)
    ]
    options = options or ["plain"] + rng.sample(choices, 2)  # (num_particles > 1 draws new minibatches)
    for option in options:
        try:
            got, grads = run(case, _option_elbo(spec, option), grads=option not in ("rws",))
        except Exception as error:  # noqa: BLE001
            if _is_refusal(error):
                continue
            checks.append(
                Check("enum", f"{option}:value", False, expected, f"{type(error).__name__}: {error}"[:300])
            )
            continue
        checks.append(Check("enum", f"{option}:value", close(got, expected), expected, got))
        for name, g in grads.items():
            want = expected_grads.get(name, torch.zeros_like(g))
            ok = torch.allclose(g, want, rtol=1e-3, atol=1e-3 * (1 + want.abs().max().item()))
            if not ok:
                checks.append(Check("enum", f"{option}:grad[{name}]", False, want.tolist(), g.tolist()))
                break
        else:
            if grads:
                checks.append(Check("enum", f"{option}:grads", True))
    checks.extend(_enum_marginal_checks(case, oracle_case, enum))
    return checks


def _enum_marginal_checks(case: Case, oracle_case: Case, enum) -> list[Check]:
    spec = case.spec
    names = [s.name for s in spec.latents() if s.treatment == "enum" and s.level != "chain"]
    names = [n for n in names if spec.site(n).kind in ("Categorical", "Bernoulli")]
    if not names:
        return []
    model, guide = fresh(oracle_case)
    with quiet():
        try:
            expected = enum.compute_marginals(model, guide)
        except Exception:  # noqa: BLE001  (TraceEnum_ELBO does not read this one out)
            return []
    model, guide = fresh(case)
    with quiet():
        try:
            got = tmc_elbo(spec).compute_marginals(model, guide)
        except Exception as error:  # noqa: BLE001
            return [Check("enum", "marginals", False, "marginals", f"{type(error).__name__}: {error}"[:300])]
    checks = []
    for name in names:
        if name not in expected:
            continue
        want = _support_probs(expected[name], spec.site(name).kind)
        have = _empirical_support_probs(got[name], want.shape[-1])
        ok = have.shape == want.shape and torch.allclose(have, want, atol=1e-4)
        checks.append(Check("enum", f"marginal[{name}]", ok, want.tolist(), have.tolist()))
    return checks


def _support_probs(marginal, kind: str) -> torch.Tensor:
    """P(value = v) for v = 0..C-1, batched over plates (TraceEnum_ELBO's marginal)."""
    if kind == "Bernoulli":
        p = marginal.probs
        return torch.stack([1 - p, p], -1).reshape(-1, 2)
    return marginal.probs.reshape(-1, marginal.probs.shape[-1])


def _empirical_support_probs(empirical, num_values: int) -> torch.Tensor:
    """The same from TMC's Empirical over the (enumerated) support values."""
    samples = empirical._samples.reshape(-1, empirical._samples.shape[-1]).long()
    weights = empirical._log_weights.reshape(samples.shape).softmax(-1)
    out = torch.zeros(samples.shape[0], num_values, dtype=weights.dtype)
    return out.scatter_add_(1, samples, weights)


# --------------------------------------------------------------------------- #
# brute force over all particle combinations
# --------------------------------------------------------------------------- #


def _site_names(spec: Spec, site) -> list[str]:
    if site.level == "chain":
        return [f"{site.name}_{t}" for t in range(spec.chain.length)]
    return [site.name]


def _plate_shape(spec: Spec, level: str) -> tuple:
    """The site's value shape over plates, as a model writes it (leading ones dropped)."""
    if level == "inner":
        return tuple(p.batch for p in spec.plates)
    if level == "outer":
        return (spec.plates[0].batch, 1)
    return ()


def _particles(node: dict, mpn: int, plate_shape: tuple) -> torch.Tensor:
    """A site's particles as (K,) + plate_shape + event_shape (its own particle dim first)."""
    value = node["value"].detach()
    event_dim = node["fn"].event_dim
    batch_ndim = value.dim() - event_dim
    dim = node["infer"]["_enumerate_dim"]
    if batch_ndim < -dim:
        value = value.reshape((1,) * (-dim - batch_ndim) + value.shape)
        batch_ndim = -dim
    value = value.movedim(batch_ndim + dim, 0)
    event = value.shape[batch_ndim:]
    rest = value.shape[1:batch_ndim]
    kept = rest[len(rest) - min(mpn, len(rest)) :]
    assert all(s == 1 for s in rest[: len(rest) - len(kept)]), f"{node['name']} carries another particle dim"
    value = value.reshape((value.shape[0],) + tuple(kept) + tuple(event))
    full = (1,) * (mpn - len(kept))
    value = value.reshape((value.shape[0],) + full + tuple(kept) + tuple(event))
    target = (1,) * (mpn - len(plate_shape)) + tuple(plate_shape)
    value = value.expand((value.shape[0],) + target + tuple(event))
    return value.reshape((value.shape[0],) + tuple(plate_shape) + tuple(event))


def brute_force(case: Case, draw, joint: bool = False) -> dict:
    """
    ``{"log_estimate", "marginals"}`` of one draw, by listing every combination: each
    sampled (site, plate element) takes one of its K particles, each enumerated one a
    value of its support; the weight is p(x, z) / q(z), with q the guide's density (the
    prior's for model-only latents, which have no latent parents here). ``joint``: the
    sampled coordinates share one particle index (IWAE).
    """
    spec = case.spec
    mpn = spec.max_plate_nesting
    coords = []  # (site name, element index, number of options, sampled?)
    values = {}  # site name -> (options,) + plate_shape + event
    kinds = {}
    for site in spec.latents():
        for name in _site_names(spec, site):
            shape = _plate_shape(spec, site.level)
            if site.treatment == "delta":
                values[name] = draw.guide_trace.nodes[name]["value"].detach()
                kinds[name] = "delta"
                continue
            trace = draw.guide_trace if site.treatment in ("guide", "genum") else draw.model_trace
            node = trace.nodes[name]
            particles = _particles(node, mpn, shape)
            values[name] = particles
            sampled = site.treatment in ("guide", "prior")
            kinds[name] = site.treatment
            elements = max(1, math.prod(shape))
            for e in range(elements):
                coords.append((name, e, particles.shape[0], sampled))
    sampled_coords = [i for i, c in enumerate(coords) if c[3]]
    if joint:
        K = coords[sampled_coords[0]][2] if sampled_coords else 1
        other = [range(c[2]) if not c[3] else range(1) for c in coords]
        combos = []
        for k in range(K):
            for choice in itertools.product(*other):
                combos.append([k if coords[i][3] else choice[i] for i in range(len(coords))])
    else:
        combos = [list(c) for c in itertools.product(*[range(c[2]) for c in coords])]
    index = torch.tensor(combos, dtype=torch.long).reshape(len(combos), len(coords))
    conditioned = {}
    for name, particles in values.items():
        if kinds[name] == "delta":
            conditioned[name] = particles
            continue
        columns = [i for i, c in enumerate(coords) if c[0] == name]
        picks = index[:, columns]  # (C, elements)
        event = particles.shape[1 + len(_shape_of(particles, name, spec)) :]
        flat = particles.reshape(particles.shape[0], -1, *event)  # (K, elements, event)
        chosen = flat[picks, torch.arange(flat.shape[1])]  # (C, elements, event)
        plate_shape = _shape_of(particles, name, spec)
        chosen = chosen.reshape((len(combos),) + (1,) * (mpn - len(plate_shape)) + plate_shape + tuple(event))
        conditioned[name] = chosen
    log_w = _log_weights(case, conditioned, kinds, mpn, len(combos))
    log_k = (
        sum(math.log(coords[i][2]) for i in sampled_coords)
        if not joint
        else (math.log(coords[sampled_coords[0]][2]) if sampled_coords else 0.0)
    )
    log_estimate = torch.logsumexp(log_w, 0) - log_k
    posterior = (log_w - torch.logsumexp(log_w, 0)).exp()
    marginals = {}
    for i, (name, _element, options, _) in enumerate(coords):
        probs = torch.zeros(options, dtype=posterior.dtype).index_add_(0, index[:, i], posterior)
        marginals.setdefault(name, []).append(probs)
    return {
        "log_estimate": log_estimate.item(),
        "marginals": {n: torch.stack(v) for n, v in marginals.items()},
        "particles": {n: v for n, v in values.items() if kinds[n] != "delta"},
    }


def _shape_of(particles, name, spec) -> tuple:
    base = name.rsplit("_", 1)[0] if spec.chain is not None and name.startswith("h_") else name
    return _plate_shape(spec, spec.site(base).level)


def _log_weights(case: Case, conditioned: dict, kinds: dict, mpn: int, count: int) -> torch.Tensor:
    """log p(x, z) - log q(z) for every listed combination (a leading batch dim of size ``count``)."""
    model, guide = case.build()
    model_trace = poutine.trace(poutine.condition(model, data=conditioned)).get_trace()
    guide_data = {n: v for n, v in conditioned.items() if kinds[n] in ("guide", "delta", "genum")}
    guide_trace = poutine.trace(poutine.condition(guide, data=guide_data)).get_trace()
    model_trace.compute_log_prob()
    guide_trace.compute_log_prob()
    total = torch.zeros(count, dtype=torch.get_default_dtype())

    def add(log_prob, sign):
        nonlocal total
        lp = log_prob.detach()
        lp = lp.reshape((1,) * max(0, mpn + 1 - lp.dim()) + lp.shape)
        if lp.dim() > mpn and lp.shape[0] == count and lp.dim() == mpn + 1:
            total = total + sign * lp.reshape(count, -1).sum(-1)
        else:
            total = total + sign * lp.sum()

    for name, node in model_trace.nodes.items():
        if node["type"] == "sample" and name != "m":  # m: the irrelevant latent, p/q = 1 (or summed to 1)
            add(node["log_prob"], 1.0)
            if kinds.get(name) == "prior":
                add(node["log_prob"], -1.0)  # the prior is its proposal
    for name, node in guide_trace.nodes.items():
        if node["type"] == "sample" and kinds.get(name) == "guide":
            add(node["log_prob"], -1.0)
    return total


def brute_force_oracle(case: Case) -> list[Check]:
    """log P_TMC (and IWAE) of one draw, and its marginal weights, against the list of all combinations."""
    spec = case.spec
    if spec.family != "brute":
        raise NotApplicable
    checks = []
    for loss in ("TMC_ELBO", "IWAE_ELBO"):
        elbo = tmc_elbo(spec, loss)
        model, guide = fresh(case)
        with quiet(), torch.no_grad():
            try:
                draw = elbo.draw(model, guide)
                got = draw.log_estimate().item()
            except Exception as error:  # noqa: BLE001
                if _is_refusal(error):
                    continue
                checks.append(
                    Check(
                        "brute", f"{loss}:value", False, "a value", f"{type(error).__name__}: {error}"[:300]
                    )
                )
                continue
        truth = brute_force(case, draw, joint=loss == "IWAE_ELBO")
        checks.append(
            Check("brute", f"{loss}:value", close(got, truth["log_estimate"]), truth["log_estimate"], got)
        )
        if loss == "TMC_ELBO":
            checks.extend(_brute_marginal_checks(draw, truth["marginals"]))
            checks.extend(_posterior_draw_checks(draw, truth))
    return checks


def _brute_marginal_checks(draw, expected: dict[str, torch.Tensor]) -> list[Check]:
    try:
        with quiet():
            got = draw.marginals()
    except Exception as error:  # noqa: BLE001
        return [Check("brute", "marginals", False, "marginals", f"{type(error).__name__}: {error}"[:300])]
    checks = []
    for name, want in expected.items():
        if name not in got:
            checks.append(Check("brute", f"marginal[{name}]", False, "a marginal", "missing"))
            continue
        log_w = got[name]._log_weights
        have = log_w.reshape(-1, log_w.shape[-1]).exp()
        ok = have.shape == want.shape and torch.allclose(have, want.to(have.dtype), atol=1e-4)
        checks.append(Check("brute", f"marginal[{name}]", ok, want.tolist(), have.tolist()))
    return checks


#: joint posterior draws per brute-force case (frequencies within 5 binomial SEs of the marginals)
NUM_POSTERIOR_DRAWS = 2000


def _posterior_draw_checks(draw, truth: dict) -> list[Check]:
    """``sample_posterior``'s draws of each site's particles have the frequencies of its exact marginals."""
    try:
        with quiet(), torch.no_grad():
            samples = draw.sample(NUM_POSTERIOR_DRAWS)
    except Exception as error:  # noqa: BLE001
        return [Check("brute", "sample_posterior", False, "draws", f"{type(error).__name__}: {error}"[:300])]
    checks = []
    for name, want in truth["marginals"].items():
        particles = truth["particles"][name]
        if name not in samples:
            checks.append(Check("brute", f"sample_posterior[{name}]", False, "draws", "missing"))
            continue
        count, elements = particles.shape[0], want.shape[0]
        options = particles.reshape(count, elements, -1).to(samples[name].dtype)
        drawn = samples[name].reshape(NUM_POSTERIOR_DRAWS, elements, -1)
        matches = (drawn[:, None] == options[None]).all(-1)  # (draws, K, elements)
        if not bool((matches.sum(1) >= 1).all()):
            checks.append(
                Check("brute", f"sample_posterior[{name}]", False, "one of the particles", "another value")
            )
            continue
        frequency = matches.double().div(matches.sum(1, keepdim=True)).mean(0).T  # (elements, K)
        p = want.double().clamp(0.0, 1.0)
        se = (p * (1 - p) / NUM_POSTERIOR_DRAWS).sqrt()
        ok = bool(((frequency - p).abs() <= 5 * se + 2e-3).all())
        checks.append(Check("brute", f"sample_posterior[{name}]", ok, p.tolist(), frequency.tolist()))
    return checks


# --------------------------------------------------------------------------- #
# scale twins
# --------------------------------------------------------------------------- #


def twin_of(case: Case) -> Case:
    """The full plate with the same datum in each element: the objective a subsample (or scale) stands for."""
    twin = case.variant()
    plate = twin.spec.plates[-1]
    if twin.spec.plate_scale is not None:
        plate.size = int(plate.size * twin.spec.plate_scale)
        twin.spec.plate_scale = None
    plate.subsample = None
    plate.subsample_size = None
    return twin


def twin_oracle(case: Case) -> list[Check]:
    """A subsampled or scaled plate against the full plate holding the same datum in each element."""
    spec = case.spec
    if spec.family != "twin":
        raise NotApplicable
    twin = twin_of(case)
    checks = []
    for loss in ("TMC_ELBO", "IWAE_ELBO"):
        try:
            expected, _ = run(twin, tmc_elbo(spec, loss))
            got, _ = run(case, tmc_elbo(spec, loss))
        except Exception as error:  # noqa: BLE001
            if _is_refusal(error):
                continue
            checks.append(
                Check("twin", f"{loss}:value", False, "a value", f"{type(error).__name__}: {error}"[:300])
            )
            continue
        checks.append(Check("twin", f"{loss}:value", close(got, expected), expected, got))
    return checks


# --------------------------------------------------------------------------- #
# float32 against float64 on identical particles
# --------------------------------------------------------------------------- #

#: the torch modules that bind ``_standard_normal`` at import (each is patched)
_STANDARD_NORMAL_USERS = (
    torch_normal,
    torch_mvn,
    torch_lowrank_mvn,
    torch_student_t,
    torch_distribution_utils,
)


def _in_float64(sample: Callable) -> Callable:
    """``sample`` run on float64 inputs, its floating output cast back to the first input's dtype."""

    def wrapped(*args, **kwargs):
        dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
        if dtype is None:
            return sample(*args, **kwargs)
        args = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        out = sample(*args, **kwargs)
        return out.to(dtype) if out.is_floating_point() else out

    return wrapped


@contextlib.contextmanager
def float64_randomness():
    """
    Every random number drawn in float64 and cast to the working dtype, so that a float32 run
    draws the particles of the float64 run (up to the cast): torch's samplers patched where the
    distributions call them.
    """
    normal = torch_distribution_utils._standard_normal
    dirichlet = torch_dirichlet._Dirichlet
    rand = torch.rand

    class Dirichlet64:
        @staticmethod
        def apply(concentration):
            return dirichlet.apply(concentration.double()).to(concentration.dtype)

    def standard_normal(shape, dtype, device):
        return normal(shape, torch.float64, device).to(dtype)

    def rand64(*size, dtype=None, **kwargs):
        return rand(*size, dtype=torch.float64, **kwargs).to(dtype or torch.get_default_dtype())

    patches = [(module, "_standard_normal", standard_normal) for module in _STANDARD_NORMAL_USERS]
    patches += [
        (torch_gamma, "_standard_gamma", _in_float64(torch_gamma._standard_gamma)),
        (torch_dirichlet, "_Dirichlet", Dirichlet64),
        (torch, "multinomial", _in_float64(torch.multinomial)),
        (torch, "bernoulli", _in_float64(torch.bernoulli)),
        (torch, "binomial", _in_float64(torch.binomial)),
        (torch, "rand", rand64),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@contextlib.contextmanager
def default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def dtype_oracle(case: Case, rtol: float = 1e-3) -> list[Check]:
    """float32 and float64 give the same value on the same particles."""
    spec = case.spec
    values = {}
    with float64_randomness():
        for dtype in (torch.float64, torch.float32):
            with default_dtype(dtype):
                try:
                    values[dtype], _ = run(case, tmc_elbo(spec))
                except Exception as error:  # noqa: BLE001
                    values[dtype] = f"{type(error).__name__}: {str(error)[:200]}"
    v64, v32 = values[torch.float64], values[torch.float32]
    if isinstance(v64, str):
        return [Check("dtype", "float64 runs", False, "a value", v64)]
    if isinstance(v32, str):
        return [Check("dtype", "float32", False, v64, v32)]
    return [Check("dtype", "float32 vs float64", close(v32, v64, rtol), v64, v32)]


# --------------------------------------------------------------------------- #
# invariances
# --------------------------------------------------------------------------- #


def _same_value(
    name: str, case: Case, reference: float, make: Callable, other: Optional[Case] = None
) -> Check:
    try:
        got, _ = run(other or case, make())
    except Exception as error:  # noqa: BLE001
        if _is_refusal(error):
            return None
        return Check("invariance", name, False, reference, f"{type(error).__name__}: {str(error)[:300]}")
    return Check("invariance", name, close(got, reference), reference, got)


def _later_prior_sites(spec: Spec) -> bool:
    """Whether a latent drawn from its prior comes after the irrelevant latent (then draws shift)."""
    return any(s.treatment == "prior" and s.level in ("chain", "after") for s in spec.sites)


def invariance_oracle(case: Case, which=None) -> list[Check]:
    """The value of one draw (same seed) under options and rewritings that must not change it."""
    spec = case.spec
    try:
        reference, _ = run(case, tmc_elbo(spec))
    except Exception as error:  # noqa: BLE001
        return [Check("invariance", "runs", False, "a value", f"{type(error).__name__}: {str(error)[:300]}")]
    rng = __import__("random").Random(spec.seed + 1)
    which = which or ["stl", "dregs", "rws", "max_factor_bytes", "markov", "irrelevant", "num_particles"]
    if rng.random() < 0.1 and "compile" not in which:
        which = which + ["compile"]
    checks = []
    for option in which:
        if option in ("stl", "dregs"):
            checks.append(
                _same_value(
                    f"variance_reduction={option}",
                    case,
                    reference,
                    lambda option=option: tmc_elbo(spec, variance_reduction=option),
                )
            )
        elif option == "rws":
            checks.append(_same_value("TMC_RWS", case, reference, lambda: tmc_elbo(spec, "TMC_RWS")))
        elif option == "max_factor_bytes":
            budget = spec.options["max_factor_bytes"]
            checks.append(
                _same_value(
                    f"max_factor_bytes={budget}",
                    case,
                    reference,
                    lambda budget=budget: tmc_elbo(spec, max_factor_bytes=budget),
                )
            )
        elif option == "compile":
            checks.append(
                _same_value("compile=graph", case, reference, lambda: tmc_elbo(spec, compile="graph"))
            )
        elif option == "num_particles":
            try:
                two, _ = run(case, tmc_elbo(spec), repeats=2)
            except Exception as error:  # noqa: BLE001
                checks.append(Check("invariance", "num_particles", False, "a value", f"{error}"[:300]))
                continue
            checks.append(_same_value("num_particles=2", case, two, lambda: tmc_elbo(spec, num_particles=2)))
        elif option == "markov" and spec.chain is not None:
            for mm, gm, refused in _markov_variants(spec):
                other = case.variant()
                other.spec.chain.markov_model, other.spec.chain.markov_guide = mm, gm
                if refused:
                    checks.append(_refuses_clearly(f"markov(model={mm},guide={gm}) refuses", case, other))
                    continue
                checks.append(
                    _same_value(
                        f"markov(model={mm},guide={gm})", case, reference, lambda: tmc_elbo(spec), other
                    )
                )
        elif option == "irrelevant" and spec.chain is not None and not _later_prior_sites(spec):
            # a model scale that a guide factor or an AutoGuide's auxiliary site does not share
            auxiliary = spec.autoguide in ("AutoNormal", "AutoMultivariateNormal")
            tempered = spec.model_scale is not None and (spec.guide_factor is not None or auxiliary)
            for kind in ("prior", "enum", "plate", None):
                if kind == spec.irrelevant or (tempered and "enum" in (kind, spec.irrelevant)):
                    # tempers each site: an enumerated m then gives sum_m p(m)^s != 1 (API.md,
                    # poutine.scale), so m is not irrelevant
                    continue
                other = case.variant(irrelevant=kind)
                if other.spec.max_plate_nesting != spec.max_plate_nesting:
                    continue
                checks.append(
                    _same_value(
                        f"irrelevant latent {kind} (case has {spec.irrelevant})",
                        case,
                        reference,
                        lambda: tmc_elbo(spec),
                        other,
                    )
                )
    return [c for c in checks if c is not None]


def _markov_variants(spec: Spec) -> list[tuple]:
    """
    ``(model, guide, refused)``: where the model and the guide may write ``pyro.markov`` instead
    of the case, and whether the library must then refuse, with an error that names the site and
    says to wrap the guide's loop in ``pyro.markov``. In the chain family a long chain's model
    keeps it (its latents would need a dim each: beyond 64), a long chain's guide that a guide
    site reads the chain through (a step reading the one before, or a site after the loop) must
    keep it (its recycled dims would be read ambiguously: refused), and where the guide does not
    loop over the chain (an AutoGuide's, the prior's) its loop is not varied.
    """
    current = (spec.chain.markov_model, spec.chain.markov_guide)
    variants = [v for v in ((True, True), (False, False), (True, False), (False, True)) if v != current]
    if spec.family != "chain":
        return [(mm, gm, False) for mm, gm in variants]
    h = spec.site("h")
    long = spec.chain.length > 64
    hand = h.treatment in ("guide", "nonfact", "delta", "genum")
    # a prior-drawn step with two particle parents (history 2) chooses its ancestors parent dim by
    # parent dim, in the order of the dims, which the model's pyro.markov recycling changes from
    # the fifth step on: other draws, each estimate exact on its own (brute force, 5 steps)
    redrawn = (
        h.treatment == "prior"
        and spec.chain.history == 2
        and spec.chain.length > 4
        and spec.options["proposal"] in ("mixture", "permutation")
    )
    reads_chain = h.treatment == "nonfact" or any(
        s.treatment == "nonfact" and s.numbers.get("guide_parent") == "h" for s in spec.latents()
    )
    out = []
    for mm, gm in variants:
        if long and not mm or not hand and gm != current[1] or redrawn and mm != current[0]:
            continue
        out.append((mm, gm, long and hand and not gm and reads_chain))
    return out


def _refuses_clearly(name: str, case: Case, other: Case) -> Check:
    """A guide whose recycled particle dims would be read ambiguously: an error naming site and fix."""
    try:
        run(other, tmc_elbo(case.spec))
    except Exception as error:  # noqa: BLE001
        message = str(error)
        ok = "Guide site '" in message and "Wrap the guide's loop over the chain in pyro.markov" in message
        return Check("invariance", name, ok, "a clear refusal", f"{type(error).__name__}: {message[:300]}")
    return Check("invariance", name, False, "a clear refusal", "a value")


# --------------------------------------------------------------------------- #
# the chain family: an AutoGuide's chain against the same guide by hand
# --------------------------------------------------------------------------- #


def chain_twin(case: Case, markov: bool) -> Case:
    """
    The case with its AutoGuide's chain written by hand: mean-field, with the AutoGuide's initial
    locations and scale (``AutoDelta``: a Delta at its locations), within ``pyro.markov`` or as a
    plain loop, and drawn after the AutoGuide's other sites, as the AutoGuide draws it.
    """
    twin = case.variant(chain_guide_last=True)
    spec = twin.spec
    h = spec.site("h")
    locs = spec.auto_init["locs"]
    h.numbers["glocs"] = [locs.get(f"h_{t}", 0.0) for t in range(spec.chain.length)]
    h.numbers["gscale"] = spec.auto_init["scale"]
    h.numbers.pop("K", None)
    h.treatment = "delta" if spec.autoguide == "AutoDelta" else "guide"
    spec.chain.markov_guide = markov
    if not any(s.treatment == "auto" for s in spec.latents()):
        spec.autoguide = None
    return twin


def _chain_grads(spec: Spec, grads: dict[str, torch.Tensor], prefix: str) -> Optional[torch.Tensor]:
    """The gradients of the chain's locations, by step (``prefix + "h_{t}"``), or ``None`` without any."""
    steps = [grads.get(f"{prefix}h_{t}") for t in range(spec.chain.length)]
    if all(g is None for g in steps):
        return None
    return torch.stack([torch.zeros(()) if g is None else g.reshape(()) for g in steps])


def chain_twin_oracle(case: Case) -> list[Check]:
    """
    ``AutoNormal`` (or ``AutoDelta``) over a chain's sites, drawn outside ``pyro.markov`` (their
    particle dims recycled along the model's markov structure), against the hand-written guide of
    :func:`chain_twin` in ``pyro.markov`` and as a plain loop: on the same draws, the same value,
    the same gradients of the chain's locations, and of every parameter the two share.
    """
    spec = case.spec
    auto_after = any(s.treatment == "auto" and s.level == "after" for s in spec.latents())
    if (
        spec.family != "chain"
        or spec.autoguide not in ("AutoNormal", "AutoDelta")
        or spec.site("h").treatment != "auto"
        or auto_after  # the AutoGuide draws it after the chain: the twin's draws would come in another order
    ):
        raise NotApplicable
    try:
        expected, expected_grads = run(case, tmc_elbo(spec), grads=True)
    except Exception as error:  # noqa: BLE001
        if _is_refusal(error):
            raise NotApplicable from error
        return [
            Check("chaintwin", "AutoGuide runs", False, "a value", f"{type(error).__name__}: {error}"[:300])
        ]
    prefix = "AutoNormal.locs." if spec.autoguide == "AutoNormal" else "AutoDelta."
    want = _chain_grads(spec, expected_grads, prefix)
    chain_params = re.compile(re.escape(spec.autoguide) + r"\.(locs\.|scales\.)?h_\d+")
    shared = {n: g for n, g in expected_grads.items() if not chain_params.fullmatch(n)}
    checks = []
    for markov in (True, False):
        label = "pyro.markov" if markov else "plain loop"
        try:
            got, grads = run(chain_twin(case, markov), tmc_elbo(spec), grads=True)
        except Exception as error:  # noqa: BLE001
            checks.append(
                Check(
                    "chaintwin", f"{label}: value", False, expected, f"{type(error).__name__}: {error}"[:300]
                )
            )
            continue
        checks.append(Check("chaintwin", f"{label}: value", close(got, expected), expected, got))
        have = grads.get("q_h_loc")
        if want is not None or have is not None:
            want_ = torch.zeros(spec.chain.length) if want is None else want
            have_ = torch.zeros(spec.chain.length) if have is None else have
            differs = _grads_differ({"chain locs": have_}, {"chain locs": want_})
        else:
            differs = None
        differs = differs or _grads_differ({n: g for n, g in grads.items() if n in shared}, shared)
        ok = differs is None
        checks.append(Check("chaintwin", f"{label}: grads", ok, "equal", differs or "equal"))
    return checks


# --------------------------------------------------------------------------- #
# memory budgets
# --------------------------------------------------------------------------- #

#: the budget every budget-family case is also run under, beside its own: below every factor
SMALLEST_BUDGET = 8


def _grads_differ(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> Optional[str]:
    """The name of the first parameter whose gradient differs from the expected one, if any."""
    for name in sorted(set(grads) | set(expected)):
        want = expected.get(name)
        have = grads.get(name)
        if want is None or have is None:
            want = torch.zeros_like(have) if want is None else want
            have = torch.zeros_like(want) if have is None else have
        if not torch.allclose(have, want, rtol=1e-3, atol=1e-3 * (1 + want.abs().max().item())):
            return name
    return None


def budget_oracle(case: Case) -> list[Check]:
    """
    Under tiny budgets (the case's ``max_factor_bytes`` and :data:`SMALLEST_BUDGET`) the value
    and gradients equal those of the same draws without a budget (``max_factor_bytes=None``):
    slicing factors and eliminating them slice by slice changes only the order of the sums.
    """
    spec = case.spec
    try:
        expected, expected_grads = run(case, tmc_elbo(spec, max_factor_bytes=None), grads=True)
    except Exception as error:  # noqa: BLE001
        if _is_refusal(error):
            raise NotApplicable from error
        return [
            Check("budget", "unbudgeted runs", False, "a value", f"{type(error).__name__}: {error}"[:300])
        ]
    checks = []
    for budget in sorted({spec.options["max_factor_bytes"], SMALLEST_BUDGET}):
        what = f"max_factor_bytes={budget}"
        try:
            got, grads = run(case, tmc_elbo(spec, max_factor_bytes=budget), grads=True)
        except Exception as error:  # noqa: BLE001
            checks.append(
                Check("budget", f"{what}:value", False, expected, f"{type(error).__name__}: {error}"[:300])
            )
            continue
        checks.append(Check("budget", f"{what}:value", close(got, expected), expected, got))
        differs = _grads_differ(grads, expected_grads)
        if differs is None:
            checks.append(Check("budget", f"{what}:grads", True))
        else:
            want = expected_grads.get(differs)
            have = grads.get(differs)
            checks.append(
                Check(
                    "budget",
                    f"{what}:grad[{differs}]",
                    False,
                    None if want is None else want.tolist(),
                    None if have is None else have.tolist(),
                )
            )
    return checks


# --------------------------------------------------------------------------- #
# read-outs
# --------------------------------------------------------------------------- #


def readout_oracle(case: Case) -> list[Check]:
    """Marginal weights sum to one per plate element; posterior draws have the plates' shapes."""
    spec = case.spec
    model, guide = fresh(case)
    elbo = tmc_elbo(spec)
    checks = []
    try:
        with quiet():
            marginals = elbo.compute_marginals(model, guide)
    except Exception as error:  # noqa: BLE001
        return [
            Check(
                "readout",
                "compute_marginals",
                False,
                "marginals",
                f"{type(error).__name__}: {str(error)[:300]}",
            )
        ]
    for name, marginal in marginals.items():
        total = marginal._log_weights.logsumexp(-1).exp()
        ok = bool(torch.allclose(total, torch.ones_like(total), atol=1e-4))
        if not ok:
            checks.append(Check("readout", f"marginal weights sum[{name}]", False, 1.0, total.tolist()))
    if not [c for c in checks if not c.ok]:
        checks.append(Check("readout", "marginal weights sum to 1", True))
    try:
        with quiet():
            draws = elbo.sample_posterior(model, guide, num_draws=3)
    except Exception as error:  # noqa: BLE001
        checks.append(
            Check(
                "readout", "sample_posterior", False, "draws", f"{type(error).__name__}: {str(error)[:300]}"
            )
        )
        return checks
    for name, value in draws.items():
        if value.shape[0] != 3 or not torch.isfinite(value.double()).all():
            checks.append(
                Check("readout", f"sample_posterior[{name}]", False, "3 finite draws", tuple(value.shape))
            )
            break
    else:
        checks.append(Check("readout", "sample_posterior shapes", True))
    return checks


# --------------------------------------------------------------------------- #
# unbiasedness on linear-Gaussian models
# --------------------------------------------------------------------------- #


def gaussian_log_evidence(spec: Spec) -> float:
    """
    Exact log p(x) of a linear-Gaussian spec: every variable is an affine function of
    independent standard normals (one per latent or observed element), so x is Gaussian.
    """
    source_data = _observed_values(spec)
    rows = {}  # (name, element) -> (mean, loading vector as dict)
    counter = itertools.count()

    def new(mean, loading, sd):
        loading = dict(loading)
        loading[next(counter)] = sd
        return mean, loading

    def combine(terms, bias):
        mean, loading = bias, {}
        for coef, (m, row) in terms:
            mean += coef * m
            for k, v in row.items():
                loading[k] = loading.get(k, 0.0) + coef * v
        return mean, loading

    def element_keys(level):
        shape = _plate_shape(spec, level)
        return list(itertools.product(*[range(s) for s in shape])) if shape else [()]

    def parent_row(parent_name, key):
        parent = spec.site(parent_name)
        if parent.level == "global":
            return rows[(parent_name, ())]
        if parent.level == "outer":
            return rows[(parent_name, (key[0], 0))]
        return rows[(parent_name, key)]

    for site in spec.sites:
        n = site.numbers
        if site.level in ("global", "inner", "outer"):
            for key in element_keys(site.level):
                terms = [(spec.site(p).numbers["coef"], parent_row(p, key)) for p in site.parents]
                mean, loading = combine(terms, n["bias"])
                rows[(site.name, key)] = new(mean, loading, n["sd"])
        elif site.name == "h":
            for t in range(spec.chain.length):
                terms = []
                if t >= 1:
                    terms.append((n["c1"], rows[("h", (t - 1,))]))
                if t >= 2 and "prev2" in site.parents:
                    terms.append((n["c2"], rows[("h", (t - 2,))]))
                for p in site.parents:
                    if p not in ("prev1", "prev2"):
                        terms.append((spec.site(p).numbers["coef"], rows[(p, ())]))
                mean, loading = combine(terms, n["bias"])
                rows[("h", (t,))] = new(mean, loading, n["sd"])
        elif site.name == "y":
            for t in range(spec.chain.length):
                h = spec.site("h").numbers["coef"]
                mean, loading = combine([(h, rows[("h", (t,))])], n["bias"])
                rows[("y", (t,))] = new(mean, loading, n["sd"])
        elif site.level == "after":
            parent = site.parents[0]
            key = (spec.chain.length - 1,) if parent == "h" else ()
            mean, loading = combine([(spec.site(parent).numbers["coef"], rows[(parent, key)])], n["bias"])
            rows[(site.name, ())] = new(mean, loading, n["sd"])
    observed = [(k, v) for k, v in rows.items() if spec.site(k[0]).observed]
    size = next(counter)
    means = torch.tensor([m for _, (m, _) in observed], dtype=torch.float64)
    loadings = torch.zeros(len(observed), size, dtype=torch.float64)
    for i, (_, (_, loading)) in enumerate(observed):
        for k, v in loading.items():
            loadings[i, k] = v
    x = torch.tensor([source_data[k] for k, _ in observed], dtype=torch.float64)
    cov = loadings @ loadings.T
    return torch.distributions.MultivariateNormal(means, cov).log_prob(x).item()


def _observed_values(spec: Spec) -> dict:
    """(name, element) -> observed value, read from the rendered source's data."""
    with default_dtype(torch.float64):
        namespace = {}
        exec(compile(Case(spec).source, "<gauss>", "exec"), namespace)
    out = {}
    for site in spec.sites:
        if not site.observed:
            continue
        if site.level == "chain":
            data = namespace[f"Y_{site.name.upper()}"]
            for t in range(spec.chain.length):
                out[(site.name, (t,))] = data[t].item()
            continue
        data = namespace[f"X_{site.name.upper()}"]
        if site.level in {"global", "after"}:
            out[(site.name, ())] = data.item()
            continue
        shape = _plate_shape(spec, site.level)
        data = data.reshape(shape)
        for key in itertools.product(*[range(s) for s in shape]):
            out[(site.name, key)] = data[key].item()
    return out


def unbiasedness_oracle(case: Case, draws: int = 300) -> list[Check]:
    """The mean of P_TMC / p(x) over independent draws is 1 within 5 measured standard errors."""
    spec = case.spec
    if spec.family != "gauss" and not spec.linear_gaussian:
        raise NotApplicable
    log_p = gaussian_log_evidence(spec)
    if spec.family == "chain":  # fewer draws of a longer chain (posterior-like guides, K=16 past 64 steps)
        draws = 200 if spec.chain.length <= 64 else 100
    checks = []
    with default_dtype(torch.float64):
        for loss in ("TMC_ELBO",):
            model, guide = fresh(case, spec.seed)
            elbo = tmc_elbo(spec, loss)
            ratios = torch.zeros(0, dtype=torch.float64)
            for _ in range(2):  # a second, larger batch before a failure is reported (r is right-skewed)
                with quiet():
                    more = [(elbo.log_evidence(model, guide) - log_p).exp() for _ in range(draws)]
                ratios = torch.cat([ratios, torch.stack(more)])
                mean = ratios.mean().item()
                se = (ratios.std() / math.sqrt(len(ratios))).item()
                ok = abs(mean - 1.0) < 5 * se + 0.02
                if ok:
                    break
                draws *= 4
            checks.append(Check("unbiased", f"{loss}: mean P/p(x)", ok, 1.0, f"{mean:.4f} +- {se:.4f}"))
    return checks


# --------------------------------------------------------------------------- #
# the captured step (compile="graph")
# --------------------------------------------------------------------------- #


def with_data_as_argument(model, guide):
    """
    ``(model, guide, data)``: the case's functions called with its data tensors as one
    argument (a dict), as a captured step needs them (a tensor read from a global is not
    an input: the step would run eagerly). The functions read their globals, so the
    argument's tensors are put there for the call.
    """
    namespace = model.__globals__
    names = [name for name, value in namespace.items() if isinstance(value, torch.Tensor)]

    def calling_with(function):
        def with_data(data):
            saved = {name: namespace[name] for name in names}
            namespace.update(data)
            try:
                return function()
            finally:
                namespace.update(saved)

        return with_data

    return calling_with(model), calling_with(guide), {name: namespace[name] for name in names}


def _step(step, params: dict):
    """``step()``'s loss and the gradient it leaves in each parameter's ``.grad`` (zeros for none)."""
    for param in params.values():
        param.grad = None
    loss = step()
    return loss, {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in params.items()
    }


#: the losses the captured-step oracle runs, one per case (by seed), and the case options each takes
CAPTURED_LOSSES = ("TMC_ELBO", "TMC_ELBO", "TMC_ELBO", "IWAE_ELBO", "TMC_RWS")
#: the share of the chain family's cases that the captured-step oracle judges, and of its long
#: chains (a capture traces each step of the chain: 10-90 s at 65-120 steps)
CHAIN_CAPTURED = 0.25
CHAIN_CAPTURED_LONG = 1 / 16
CAPTURED_OPTIONS = {
    "TMC_ELBO": ("variance_reduction", "max_factor_bytes"),
    "IWAE_ELBO": ("variance_reduction",),
    "TMC_RWS": (),
}


def captures(spec: Spec) -> bool:
    """Whether the captured-step oracle judges the case: every case but the chain family's few (by seed)."""
    if spec.family != "chain":
        return True
    share = CHAIN_CAPTURED if spec.chain.length <= 64 else CHAIN_CAPTURED_LONG
    return random.Random(f"captured-{spec.seed}").random() < share


def captured_oracle(case: Case, compile: str = "graph") -> list[Check]:
    """
    The captured whole step (``compile="graph"``, rolled however small) replayed from one
    RNG state equals the eager step from that state: value and gradients. A step that
    cannot be captured (a documented fallback: it reads a value) or whose replay is redone
    eagerly (an underflow) is not judged; a crash or a failed roll is a failure.

    Every other case (odd seeds) runs in float64, as Pyro's own tests do: inductor drew a
    float64 Bernoulli's values its own way even under ``fallback_random``, which float32
    cases never showed.

    :param str compile: ``"inductor"``: the same, with the rolled step compiled by inductor
        (its own random draws replaced by torch's, ``fallback_random``, so that the numbers
        are the eager step's), to :data:`INDUCTOR_RTOL`.
    """
    if not captures(case.spec):
        raise NotApplicable
    dtype = torch.float64 if case.spec.seed % 2 else torch.get_default_dtype()
    with default_dtype(dtype):
        checks = _captured_checks(case, compile)
    if dtype == torch.float64:
        for check in checks:
            check.what += " (float64)"
    return checks


def _captured_checks(case: Case, compile: str) -> list[Check]:
    """:func:`captured_oracle`'s checks in the current default dtype."""
    spec = case.spec
    name = CAPTURED_LOSSES[spec.seed % len(CAPTURED_LOSSES)]
    options = {k: spec.options[k] for k in CAPTURED_OPTIONS[name] if spec.options.get(k)}
    if spec.chain is not None and spec.chain.length > 64:
        # every factor of a long chain sliced under a tiny budget: a capture traces every slice
        # (minutes); the eager budget is the invariance oracle's, the budget family's
        options.pop("max_factor_bytes", None)
    if compile == "inductor":
        options["compile_options"] = {"options": {"fallback_random": True}}
    rtol = INDUCTOR_RTOL if compile == "inductor" else RTOL
    label = "inductor" if compile == "inductor" else "captured"
    model, guide = fresh(case, spec.seed)
    model, guide, data = with_data_as_argument(model, guide)
    loss = tmc_elbo(spec, name, compile=compile, **options)
    loss.step_program.roll_above = 0  # roll even a small step: rolling is what is tested
    loss.step_program.choose_faster = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss.loss_and_grads(model, guide, data)  # eager: its errors are the other oracles' concern
        except Exception as error:  # noqa: BLE001
            raise NotApplicable from error
        try:
            loss.loss_and_grads(model, guide, data)  # captured
            store = pyro.get_param_store()
            params = {key: store.get_param(key).unconstrained() for key in store}
            state = torch.get_rng_state()
            replayed = _step(lambda: loss.loss_and_grads(model, guide, data), params)
        except Exception as error:  # noqa: BLE001
            return [
                Check(label, "runs", False, "no exception", f"{type(error).__name__}: {str(error)[:300]}")
            ]
    rolls = [str(w.message) for w in caught if "could not roll" in str(w.message)]
    if rolls:
        return [Check(label, "rolls", False, "rolled", rolls[0][:300])]
    if loss.step_program.replays != 1:
        raise NotApplicable  # not captured (a documented fallback), or the replay was redone eagerly
    if compile == "inductor" and not _compiled(loss):
        if any("max_inductor_nodes" in str(w.message) for w in caught):
            raise NotApplicable  # too large to compile: replayed uncompiled, as documented
        failed = [str(w.message) for w in caught if "uncompiled" in str(w.message)]
        return [Check(label, "compiles", False, "compiled", (failed or ["replayed uncompiled"])[0][:300])]
    torch.set_rng_state(state)
    with quiet():
        value, grads = _step(lambda: loss._eager_loss_and_grads(model, guide, (data,), {}), params)
    checks = [Check(label, f"{name} value", close(replayed[0], value, rtol), value, replayed[0])]
    for param, grad in grads.items():
        error = (replayed[1][param] - grad).abs().max().item()
        ok = error <= rtol * (1.0 + grad.abs().max().item())
        checks.append(Check(label, f"{name} grad {param}", ok, 0.0, error))
    return checks


def _compiled(loss) -> bool:
    """Whether the loss's captured steps all run inductor's code (its uncompiled graph kept aside)."""
    return all(step.uncompiled is not None for step in loss.step_program._steps.values() if step.program)


def inductor_oracle(case: Case) -> list[Check]:
    """:func:`captured_oracle` with the step compiled by inductor (seconds a case: not in CI's sweep)."""
    return captured_oracle(case, compile="inductor")


ORACLES: dict[str, Callable] = {
    "enum": enum_oracle,
    "brute": brute_force_oracle,
    "twin": twin_oracle,
    "dtype": dtype_oracle,
    "invariance": invariance_oracle,
    "readout": readout_oracle,
    "unbiased": unbiasedness_oracle,
    "captured": captured_oracle,
    "budget": budget_oracle,
    "chaintwin": chain_twin_oracle,
    "inductor": inductor_oracle,  # opt-in (--oracle inductor): a compile per case
}

#: which oracles judge each family
FAMILY_ORACLES = {
    "enum": ("enum", "readout", "dtype"),
    "brute": ("brute", "invariance", "captured"),
    "twin": ("twin", "dtype"),
    "general": ("dtype", "invariance", "readout", "captured"),
    "gauss": ("unbiased",),
    "budget": ("budget",),
    "chain": ("dtype", "invariance", "readout", "chaintwin", "unbiased", "captured"),
}


def check_case(case: Case, oracles=None) -> list[Check]:
    """Every applicable oracle's checks on a case; a crash of the library counts as a failed check."""
    names = oracles or FAMILY_ORACLES[case.spec.family]
    checks = []
    for name in names:
        try:
            checks.extend(ORACLES[name](case))
        except NotApplicable:
            continue
        except Exception as error:  # noqa: BLE001  (a crash of an oracle's own code is reported too)
            checks.append(
                Check(
                    name,
                    "oracle crashed",
                    False,
                    "no exception",
                    f"{type(error).__name__}: {str(error)[:300]}",
                )
            )
    return checks
