"""Random valid Pyro model/guide pairs, reproducible from an integer seed.

A case is drawn in two steps: :func:`draw_spec` turns a seed into a :class:`Spec` (a
plain description: latent and observed sites, their plates, a ``pyro.markov`` chain,
masks, scales, factors, how the guide treats each latent, and the loss options), and
:func:`render` turns a spec into Python source that defines ``model()`` and ``guide()``.
The source is the case: it prints as ordinary Pyro code, ``exec`` builds it, and an
oracle that needs a twin (the same model on replicated data, an enumerated instead of
a guide-enumerated site, an extra irrelevant latent) renders a modified copy of the spec.

Families (each picks the structures its oracles can judge exactly):

- ``"enum"``: every latent is enumerated in the model, enumerated in the guide, or a
  Delta (hand-written or ``AutoDelta``); ``TraceEnum_ELBO`` gives the exact value.
- ``"brute"``: tiny models whose K^n particle combinations can be listed.
- ``"twin"``: one plate whose elements all hold the same data, subsampled or scaled,
  beside the full plate that has the same objective.
- ``"general"``: everything (sampled, non-factorised and AutoGuide guides, priors as
  proposals); judged by float32 against float64 and by invariances.
- ``"gauss"``: linear-Gaussian models with an exact ``log p(x)`` (unbiasedness).
- ``"budget"`` (drawn only when asked for: :data:`EXTRA_FAMILIES`): globals, plates (often
  nested) and a short ``pyro.markov`` chain that reads a global, under AutoGuides (``AutoNormal``,
  ``AutoDelta``, ``AutoDiagonalNormal``, chain sites included) beside prior-drawn, enumerated and
  hand-guided latents, with tiny ``max_factor_bytes``; the unbudgeted value and gradients on the
  same draws are the oracle (R4 of issue 42: a chunked global that a chain reads kept K^T).
- ``"chain"`` (drawn only when asked for): a ``pyro.markov`` chain (history 1 or 2, reading a
  global or not) under AutoGuides (``AutoNormal``, ``AutoDelta``, ``AutoDiagonalNormal`` over the
  chain's sites, beside hand-written guides for other sites), or under a hand-written guide whose
  chain is a plain loop or within ``pyro.markov``; a fifth of the chains are long (65-120 steps,
  beyond the 64 dims a tensor holds), where ``AutoNormal`` and a plain loop rely on the particle
  dims recycled along the model's markov structure (R5 of issue 42). Three in ten are
  linear-Gaussian, judged by the exact ``log p(x)`` as the gauss family is; the AutoGuide's chain
  is also judged against a hand-written guide with the same parameters, on the same draws.
"""

import copy
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Optional

DISCRETE = ("Categorical", "Bernoulli", "Binomial", "OneHotCategorical")
CONTINUOUS = ("Normal", "Gamma", "Dirichlet")
#: how many values (or the event size) of the sites with a vector parameter
NUM_CATEGORIES = 3
FAMILIES = ("enum", "brute", "twin", "general", "gauss")
FAMILY_WEIGHTS = (0.3, 0.2, 0.15, 0.3, 0.05)
#: families drawn only when asked for (``--family budget``), so that adding one does not move the
#: seeds of the others; ``test_fuzz.py`` runs a few seeds of each
EXTRA_FAMILIES = ("budget", "chain")
#: the longest chain of the budget family (AutoNormal on long chains is R5's: keep clear of it)
BUDGET_MAX_CHAIN = 12
#: the chain family's long chains (steps), beyond the 64 dims a tensor holds, and how often
CHAIN_LONG = (65, 120)
CHAIN_LONG_FRACTION = 0.2

PRELUDE = """\
import torch
import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_feasible,
)
from pyro.ops.indexing import Vindex

ENUM = {"enumerate": "parallel"}
"""


@dataclass
class Site:
    """
    One sample site of the model.

    :param str name: the site's name (chain sites get ``_{t}`` appended).
    :param str kind: a distribution name from :data:`DISCRETE` or :data:`CONTINUOUS`.
    :param str level: ``"global"``, ``"outer"`` / ``"inner"`` (plates, nested; a single
        plate is ``"inner"``), ``"chain"`` (inside the markov loop) or ``"after"`` (after it).
    :param list parents: names of the sites it depends on (chain sites: ``"prev1"``, ``"prev2"``).
    :param str treatment: ``"obs"``; for latents ``"enum"`` (model-enumerated), ``"genum"``
        (guide-enumerated), ``"guide"`` (factorised guide), ``"nonfact"`` (the guide's
        proposal depends on an upstream guide latent), ``"delta"``, ``"prior"`` (absent from
        the guide) or ``"auto"`` (the AutoGuide's).
    :param dict numbers: the constants its distribution, its guide and its data use.
    """

    name: str
    kind: str
    level: str
    parents: list[str]
    treatment: str
    numbers: dict[str, object] = field(default_factory=dict)
    mask: Optional[list] = None
    learn: bool = False

    @property
    def observed(self) -> bool:
        return self.treatment == "obs"


@dataclass
class Plate:
    """A plate (``dim`` -1 for the inner or only plate, -2 for the outer) and its subsampling."""

    name: str
    size: int
    dim: int
    subsample_size: Optional[int] = None
    subsample: Optional[list[int]] = None  # explicit indices

    @property
    def batch(self) -> int:
        if self.subsample is not None:
            return len(self.subsample)
        return self.subsample_size or self.size


@dataclass
class Chain:
    """A ``for t in pyro.markov(range(length), history=...)`` loop (or a plain loop)."""

    length: int
    history: int
    markov_model: bool = True
    markov_guide: bool = True


@dataclass
class Spec:
    """Everything a case is made of; :func:`render` writes it as Pyro code."""

    seed: int
    family: str
    sites: list[Site]
    plates: list[Plate] = field(default_factory=list)
    chain: Optional[Chain] = None
    autoguide: Optional[str] = None  # "AutoDelta" | "AutoNormal" | "AutoMultivariateNormal"
    plate_scale: Optional[float] = None  # poutine.scale shared by every site in the plates
    model_scale: Optional[float] = None  # poutine.scale around the whole model
    factors: list[tuple[str, str, float]] = field(default_factory=list)  # (name, parent, coef)
    guide_factor: Optional[tuple[str, float]] = None  # pyro.factor in the guide: (global guide latent, coef)
    irrelevant: Optional[str] = None  # "prior" | "enum" | "plate": an extra latent nothing uses
    options: dict[str, object] = field(default_factory=dict)
    linear_gaussian: bool = False  # the chain family's linear-Gaussian cases (an exact log p(x))
    #: the chain family's AutoGuide initialisation: {"scale": init_scale, "locs": {site: value}}
    auto_init: Optional[dict[str, object]] = None
    chain_guide_last: bool = False  # the hand-written guide's chain loop comes after the AutoGuide
    features: list[str] = field(default_factory=list)

    def site(self, name: str) -> Site:
        return next(s for s in self.sites if s.name == name)

    def latents(self) -> list[Site]:
        return [s for s in self.sites if not s.observed]

    @property
    def max_plate_nesting(self) -> int:
        return max([-p.dim for p in self.plates], default=0) or (1 if self.irrelevant == "plate" else 0)


# --------------------------------------------------------------------------- #
# drawing a spec
# --------------------------------------------------------------------------- #


def _r(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), 2)


def _probs(rng: random.Random, n: int) -> list[float]:
    raw = [rng.uniform(0.2, 1.0) for _ in range(n)]
    total = sum(raw)
    probs = [round(v / total, 3) for v in raw]
    probs[-1] = round(1.0 - sum(probs[:-1]), 3)
    return probs


def _numbers(rng: random.Random, kind: str, stiff: bool) -> dict[str, object]:
    """The constants of one site: its own parameters and those of its signal to children."""
    sd_choices = (1.0, 0.5, 0.3) if not stiff else (0.1, 0.01, 0.005, 0.003)
    return {
        "bias": _r(rng, -1, 1),
        "sd": rng.choice(sd_choices),
        "coef": _r(rng, -1.5, 1.5),  # how a child reads this site (scalar sites)
        "table": [_r(rng, -2, 2) for _ in range(NUM_CATEGORIES)],  # how a child reads it (vector/discrete)
        "conc": round(rng.uniform(1.0, 3.0), 2),
        "rate": round(rng.uniform(0.5, 2.0), 2),
        "probs": _probs(rng, NUM_CATEGORIES),
        "p": round(rng.uniform(0.15, 0.85), 2),
        "trans": [_probs(rng, NUM_CATEGORIES) for _ in range(NUM_CATEGORIES)],
        "trans2": [
            [_probs(rng, NUM_CATEGORIES) for _ in range(NUM_CATEGORIES)] for _ in range(NUM_CATEGORIES)
        ],
        "w": [_r(rng, -1, 1) for _ in range(NUM_CATEGORIES)],
        "c1": _r(rng, -1.2, 1.2),
        "c2": _r(rng, -0.8, 0.8),
        "gloc": _r(rng, -1, 1),
        "gscale": round(rng.uniform(0.4, 1.5), 2),
        "gcoef": _r(rng, -0.8, 0.8),
    }


def _pick_kind(rng: random.Random, family: str, discrete_only: bool = False) -> str:
    if family == "gauss":
        return "Normal"
    if discrete_only:
        return rng.choice(DISCRETE)
    return rng.choice(DISCRETE + CONTINUOUS + ("Normal", "Normal"))


def _treatment(rng: random.Random, family: str, kind: str, level: str) -> str:
    """How the guide treats a latent of this kind, in this family."""
    discrete = kind in DISCRETE
    if family == "enum":
        if discrete:
            return rng.choice(("enum", "enum", "enum", "genum")) if level in ("global", "inner") else "enum"
        return "delta"
    if family == "twin":
        if level in ("inner", "outer"):
            return "enum" if discrete else "delta"
        return rng.choice(("enum", "genum")) if discrete else rng.choice(("guide", "delta", "guide"))
    if family == "brute":
        if discrete:
            return rng.choice(("enum", "guide", "prior", "genum"))
        return rng.choice(("guide", "guide", "delta", "prior"))
    if family == "gauss":
        return rng.choice(("guide", "prior", "nonfact"))
    if family == "budget":  # prior-drawn and enumerated latents are the ones a budget slices most
        if discrete:
            return rng.choice(("prior", "prior", "enum", "guide", "genum"))
        return rng.choice(("auto", "auto", "guide", "prior", "nonfact", "delta"))
    # general
    if discrete:
        return rng.choice(("enum", "guide", "prior", "genum"))
    return rng.choice(("guide", "delta", "prior", "nonfact", "nonfact", "auto"))


def draw_spec(seed: int, family: Optional[str] = None) -> Spec:
    """
    A random valid model/guide pair, as a :class:`Spec`.

    :param int seed: everything is drawn from ``random.Random(seed)``.
    :param str family: one of :data:`FAMILIES`; drawn from the seed when ``None``.
    """
    if family is None:
        family = random.Random(seed).choices(FAMILIES, FAMILY_WEIGHTS)[0]
    rng = random.Random(f"{family}-{seed}")  # the same case whether or not the family was asked for
    for _attempt in range(50):
        spec = _draw_structure(rng, seed, family)
        if spec is not None:
            return spec
    raise RuntimeError(f"no spec for seed {seed}")


def _draw_structure(rng: random.Random, seed: int, family: str) -> Optional[Spec]:
    if family == "chain":
        return _draw_chain_family(rng, seed)
    tiny = family == "brute"
    stiff = family == "general" and rng.random() < 0.15
    sites: list[Site] = []
    spec = Spec(seed=seed, family=family, sites=sites)

    def add(name, level, parents, kind=None, discrete_only=False, treatment=None):
        kind = kind or _pick_kind(rng, family, discrete_only)
        treatment = treatment or _treatment(rng, family, kind, level)
        site = Site(name, kind, level, list(parents), treatment, _numbers(rng, kind, stiff))
        sites.append(site)
        return site

    # globals: 0-2 latents, each may read the ones before it
    num_globals = rng.choice((0, 1, 1, 2)) if family != "budget" else rng.choice((1, 1, 2))
    for g in range(num_globals):
        earlier = [s.name for s in sites]
        parents = rng.sample(earlier, k=min(len(earlier), rng.choice((0, 1))))
        add(f"g{g}", "global", parents)
    global_names = [s.name for s in sites]

    structure = rng.choice(("plate", "plate", "chain", "both")) if family != "twin" else "plate"
    if family == "gauss":
        structure = rng.choice(("plate", "chain", "both"))
    if family == "budget":
        structure = "both"
    if structure in ("plate", "both"):
        _draw_plates(rng, spec, family, tiny, stiff, add, global_names)
    if structure in ("chain", "both"):
        _draw_chain(rng, spec, family, tiny, stiff, add, global_names)
    if not any(s.observed for s in sites):
        add("x_g", "global", global_names[-1:], kind="Normal", treatment="obs")
    _draw_global_extras(rng, spec, family)
    _draw_options(rng, spec, family)
    _fix_invalid(spec)
    if family == "gauss":
        _prior_like_guides(rng, spec)
        _prior_predictive_data(rng, spec)
    if family == "brute" and _num_combinations(spec) > 4096:
        return None
    joint = ("AutoMultivariateNormal", "AutoDiagonalNormal")
    if spec.autoguide in joint and any(p.batch != p.size for p in spec.plates):
        spec.autoguide = "AutoNormal"
    spec.features = sorted(features_of(spec))
    return spec


def _prior_like_guides(rng: random.Random, spec: Spec) -> None:
    """
    Gaussian guides a little broader than each latent's prior marginal (means and variances
    propagated through the linear model, covariances ignored, hence the margin): the ratio
    P_TMC / p(x) then has a light tail, and its sample mean a trustworthy standard error.
    """
    moments = {}  # name -> (mean, var); the chain: "h" -> per-step lists
    building = ([], [])  # the chain's lists while they are computed

    def read(parent, t=None):
        if parent in ("prev1", "prev2"):
            lag = 1 if parent == "prev1" else 2
            if t is None or t - lag < 0:
                return None
            return building[0][t - lag], building[1][t - lag]
        if parent == "h":
            return moments["h"][0][-1], moments["h"][1][-1]
        return moments[parent]

    for site in spec.sites:
        n = site.numbers
        steps = range(spec.chain.length) if site.level == "chain" else [None]
        means, variances = [], []
        building = (means, variances)
        for t in steps:
            mean, var = n["bias"], n["sd"] ** 2
            for p in site.parents:
                m = read(p, t)
                if m is None:
                    continue
                lags = {"prev1": n["c1"], "prev2": n["c2"]}
                coef = lags[p] if p in lags else spec.site(p).numbers["coef"]
                mean += coef * m[0]
                var += coef**2 * m[1]
            means.append(mean)
            variances.append(var)
        if site.level == "chain":
            moments[site.name] = (means, variances)
        else:
            moments[site.name] = (means[0], variances[0])
        if site.observed:
            continue
        margin = rng.uniform(1.2, 1.5)
        n["gloc"] = round(means[0], 2)
        n["glocs"] = [round(m, 2) for m in means]
        n["gscale"] = round(margin * max(variances) ** 0.5, 2)
        if site.treatment == "nonfact" and site.level == "chain":  # the prior's conditional on prev1
            n["gcoef"] = n["c1"]
            n["glocs"] = [round(means[0], 2)] + [
                round(means[t] - n["c1"] * means[t - 1], 2) for t in range(1, len(means))
            ]
        elif site.treatment == "nonfact":  # the prior's conditional on its guide parent
            parent = n["guide_parent"]
            n["gcoef"] = spec.site(parent).numbers["coef"]
            n["gloc"] = round(means[0] - n["gcoef"] * read(parent)[0], 2)


def _gaussian_rows(spec: Spec) -> dict[tuple, tuple[float, dict[int, float]]]:
    """
    Every element of a linear-Gaussian spec, ``(site, key) -> (mean, {noise: loading})``, as an
    affine function of independent standard normals (one per element), in the model's order.
    """
    rows: dict[tuple, tuple[float, dict[int, float]]] = {}
    noises = itertools.count()

    def keys(level):
        if level not in ("inner", "outer"):
            return [()]
        shape = [p.size for p in spec.plates] if level == "inner" else [spec.plates[0].size]
        return list(itertools.product(*[range(n) for n in shape]))

    def parent_row(parent, key, t):
        if parent in ("prev1", "prev2"):
            lag = 1 if parent == "prev1" else 2
            return rows.get(("h", (t - lag,)))
        if parent == "h":
            return rows[("h", (spec.chain.length - 1,))] if t is None else rows[("h", (t,))]
        level = spec.site(parent).level
        return rows[(parent, () if level == "global" else key[:1] if level == "outer" else key)]

    for site in spec.sites:
        n = site.numbers
        if site.level == "chain":
            elements = [((t,), t) for t in range(spec.chain.length)]
        else:
            elements = [(key, None) for key in keys(site.level)]
        for key, t in elements:
            mean, loading = n["bias"], {next(noises): n["sd"]}
            for p in site.parents:
                row = parent_row(p, key, t)
                if row is None:
                    continue
                coef = n["c1"] if p == "prev1" else n["c2"] if p == "prev2" else spec.site(p).numbers["coef"]
                mean += coef * row[0]
                for k, v in row[1].items():
                    loading[k] = loading.get(k, 0.0) + coef * v
            rows[(site.name, key)] = (mean, loading)
    return rows


def _observed_data(spec: Spec, site: Site, key: tuple) -> float:
    """The datum of one observed element (:func:`_prior_predictive_data`'s)."""
    data = site.numbers["data"]
    if site.level in ("global", "after"):
        return data
    if site.level == "chain":
        return data[key[0]]
    if site.level == "inner" and len(spec.plates) == 2:
        return data[key[0]][key[1]]
    return data[key[0]]


def _posterior_like_guides(rng: random.Random, spec: Spec) -> None:
    """
    Gaussian guides a little broader than each latent's exact posterior marginal (the chain
    family's linear-Gaussian cases, whose chains are up to 120 steps long: a guide like the
    prior's then makes P_TMC / p(x) vanishingly small, with no usable mean). A guide that reads
    a parent (``nonfact``) takes the posterior regression on it. Plate elements share one guide:
    their means averaged, the broadest scale.
    """
    import torch  # (the generator needs it only here)

    rows = _gaussian_rows(spec)
    names = list(rows)
    width = 1 + max(k for _, loading in rows.values() for k in loading)
    loadings = torch.zeros(len(names), width, dtype=torch.float64)
    for i, name in enumerate(names):
        for k, v in rows[name][1].items():
            loadings[i, k] = v
    means = torch.tensor([rows[name][0] for name in names], dtype=torch.float64)
    observed = [i for i, (site, _) in enumerate(names) if spec.site(site).observed]
    latent = [i for i, (site, _) in enumerate(names) if not spec.site(site).observed]
    x = torch.tensor([_observed_data(spec, spec.site(names[i][0]), names[i][1]) for i in observed])
    cov = loadings @ loadings.T
    gain = torch.linalg.solve(cov[observed][:, observed], cov[observed][:, latent]).T
    post_mean = means[latent] + gain @ (x.double() - means[observed])
    post_cov = cov[latent][:, latent] - gain @ cov[observed][:, latent]
    index = {names[i]: j for j, i in enumerate(latent)}

    def elements(site):
        return [index[name] for name in names if name[0] == site.name]

    def up(value):
        return math.ceil(100 * value) / 100

    for site in spec.latents():
        n = site.numbers
        mine = elements(site)
        margin = rng.uniform(1.2, 1.4)
        sds = post_cov.diagonal()[mine].sqrt()
        n["gloc"] = round(post_mean[mine].mean().item(), 2)
        n["glocs"] = [round(v, 2) for v in post_mean[mine].tolist()]
        n["gscale"] = up(margin * sds.max().item())
        if site.treatment != "nonfact":
            continue
        if site.level == "chain":  # loc_t = glocs[t] + gcoef * h_{t-1}
            pairs = list(zip(mine[1:], mine[:-1])) or [(mine[0], mine[0])]
            coef = sum((post_cov[a, b] / post_cov[b, b]).item() for a, b in pairs) / len(pairs)
            n["gcoef"] = round(coef, 2) if len(mine) > 1 else 0.0
            n["glocs"] = [n["glocs"][0]] + [
                round((post_mean[a] - n["gcoef"] * post_mean[b]).item(), 2)
                for a, b in zip(mine[1:], mine[:-1])
            ]
            residual = [post_cov[mine[0], mine[0]].item()] + [
                (post_cov[a, a] - 2 * n["gcoef"] * post_cov[a, b] + n["gcoef"] ** 2 * post_cov[b, b]).item()
                for a, b in zip(mine[1:], mine[:-1])
            ]
        else:  # loc = gloc + gcoef * parent (parent: a global or this element's)
            parent = spec.site(n["guide_parent"])
            theirs = elements(parent)
            pairs = [
                (a, theirs[0] if len(theirs) == 1 else theirs[i % len(theirs)]) for i, a in enumerate(mine)
            ]
            coef = sum((post_cov[a, b] / post_cov[b, b]).item() for a, b in pairs) / len(pairs)
            n["gcoef"] = round(coef, 2)
            n["gloc"] = round(
                sum((post_mean[a] - n["gcoef"] * post_mean[b]).item() for a, b in pairs) / len(pairs), 2
            )
            residual = [
                (post_cov[a, a] - 2 * n["gcoef"] * post_cov[a, b] + n["gcoef"] ** 2 * post_cov[b, b]).item()
                for a, b in pairs
            ]
        n["gscale"] = up(margin * max(residual) ** 0.5)


def _prior_predictive_data(rng: random.Random, spec: Spec) -> None:
    """Observations drawn from the linear-Gaussian model itself (no outliers), kept in ``numbers["data"]``."""
    values = {}  # (name, element key) -> value

    def keys(level):
        shape = (
            [p.size for p in spec.plates]
            if level == "inner"
            else [spec.plates[0].size]
            if level == "outer"
            else []
        )
        return list(itertools.product(*[range(n) for n in shape])) if shape else [()]

    def parent_value(parent, key, t):
        if parent in ("prev1", "prev2"):
            lag = 1 if parent == "prev1" else 2
            return values.get(("h", (t - lag,))) if t is not None else None
        if parent == "h":
            return values[("h", (spec.chain.length - 1,))] if t is None else values[("h", (t,))]
        level = spec.site(parent).level
        return values[(parent, () if level == "global" else key[:1] if level == "outer" else key)]

    for site in spec.sites:
        n = site.numbers
        if site.level == "chain":
            elements = [((t,), t) for t in range(spec.chain.length)]
        else:
            elements = [
                (key, None) for key in keys(site.level if site.level in ("inner", "outer") else "global")
            ]
        for key, t in elements:
            mean = n["bias"]
            for p in site.parents:
                v = parent_value(p, key, t)
                if v is None:
                    continue
                coef = n["c1"] if p == "prev1" else n["c2"] if p == "prev2" else spec.site(p).numbers["coef"]
                mean += coef * v
            values[(site.name, key)] = mean + n["sd"] * rng.gauss(0.0, 1.0)
        if site.observed:
            data = [round(values[(site.name, key)], 2) for key, _ in elements]
            if site.level == "inner" and len(spec.plates) == 2:
                width = spec.plates[1].size
                data = [data[r * width : (r + 1) * width] for r in range(spec.plates[0].size)]
            elif site.level in ("global", "after"):
                data = data[0]
            n["data"] = data


def _draw_plates(rng, spec, family, tiny, stiff, add, global_names):
    nested = rng.random() < {"brute": 0.2, "budget": 0.6}.get(family, 0.3) and family != "twin"
    big = stiff and rng.random() < 0.5
    sizes = (1, 2, 3, 4, 5) if not tiny else (1, 2)
    if family == "gauss":
        sizes = (1, 2)
    inner_size = rng.choice(sizes) if not big else rng.choice((50, 100))
    inner = Plate("data", inner_size, -1)
    spec.plates.append(inner)
    outer = None
    if nested:
        outer = Plate("outer", rng.choice(sizes), -2)
        spec.plates.insert(0, outer)
    if family not in ("brute", "gauss"):
        for plate in spec.plates:
            _draw_subsample(rng, plate, family)
    levels = ["inner"] if outer is None else ["outer", "inner"]
    upstream = list(global_names)
    for level in levels:
        count = rng.choice((0, 1, 1, 2)) if not big else 0
        for j in range(count):
            name = f"z{level[0]}{j}"
            parents = rng.sample(upstream, k=min(len(upstream), rng.choice((0, 1, 1))))
            add(name, level, parents)
            upstream.append(name)
    readable = [n for n in upstream]
    parents = rng.sample(readable, k=min(len(readable), rng.choice((1, 1, 2))))
    obs_kind = "Normal" if family == "gauss" else rng.choice(("Normal", "Normal", "Normal", "Bernoulli"))
    obs = add("x", "inner", parents, kind=obs_kind, treatment="obs")
    if family not in ("brute", "gauss") and rng.random() < 0.25:
        obs.mask = [rng.random() < 0.7 for _ in range(inner.size * (outer.size if outer else 1))]
    if family in ("enum", "general", "twin") and rng.random() < 0.25:
        spec.plate_scale = rng.choice((0.5, 2.0, 3.0))
    if family == "twin":
        _make_twin_ready(rng, spec, obs)


def _draw_subsample(rng, plate, family):
    choice = rng.choice(("none", "none", "size", "indices"))
    if family == "budget":  # seldom: AutoGuides then leave the plates to the hand-written guide
        choice = rng.choice(("none",) * 6 + ("size", "indices"))
    if family == "twin":
        choice = rng.choice(("size", "indices", "indices"))
    if choice == "size" and plate.size > 1:
        plate.subsample_size = rng.randint(1, plate.size - 1) if plate.size > 1 else 1
    elif choice == "indices":
        batch = rng.randint(1, plate.size)
        plate.subsample = sorted(rng.sample(range(plate.size), batch))


def _make_twin_ready(rng, spec, obs):
    """Scale twins need one datum for all elements, one Delta per element, no mask."""
    obs.mask = None
    plate = spec.plates[-1]
    if plate.size == 1:
        plate.size = rng.choice((2, 3, 4))
        plate.subsample = None
        plate.subsample_size = None
    if plate.batch == plate.size and spec.plate_scale is None:
        plate.subsample = sorted(rng.sample(range(plate.size), rng.randint(1, plate.size - 1)))
    if spec.plate_scale is not None:
        spec.plate_scale = float(rng.choice((2, 3)))
        plate.subsample = None
        plate.subsample_size = None
    for site in spec.sites:
        site.numbers["same_data"] = True


def _draw_chain(rng, spec, family, tiny, stiff, add, global_names):
    length = rng.choice((1, 2, 3, 4)) if not tiny and family != "gauss" else rng.choice((1, 2))
    if stiff:
        length = rng.choice((6, 12))
    if family == "budget":
        length = rng.choice((2, 3, 4, 6, 8, BUDGET_MAX_CHAIN))
    history = rng.choice((1, 2))
    chain = Chain(length, history)
    if family not in ("enum",):
        chain.markov_model = rng.random() < 0.8
        chain.markov_guide = rng.random() < 0.8
    spec.chain = chain
    kind = "Normal" if family == "gauss" else rng.choice(("Normal", "Normal", "Categorical", "Bernoulli"))
    if stiff:
        kind = "Normal"
    if family == "budget":  # mostly continuous: an AutoGuide's chain
        kind = rng.choice(("Normal", "Normal", "Normal", "Normal", "Categorical", "Bernoulli"))
    parents = ["prev1"] + (["prev2"] if history == 2 else [])
    reads = rng.choice((0, 1)) if family != "budget" else rng.choice((0, 1, 1, 1))
    read_globals = rng.sample(global_names, k=min(len(global_names), reads))
    parents += read_globals
    h = add("h", "chain", parents, kind=kind)
    if stiff:
        h.numbers["sd"] = rng.choice((0.01, 0.005))
        h.numbers["c1"] = 1.0
        h.treatment = rng.choice(("guide", "nonfact"))
    # the budget family's observations may read a global too (a chunked global that every step
    # reads: the message that R4 of issue 42 found)
    extra = (
        rng.sample(global_names, k=min(len(global_names), rng.choice((0, 1)))) if family == "budget" else []
    )
    add("y", "chain", ["h"] + extra, kind="Normal", treatment="obs")
    if rng.random() < 0.35 and family != "enum":
        kind = "Normal" if family == "gauss" else rng.choice(("Normal", "Categorical"))
        add("d", "after", ["h"], kind=kind)
        add("yd", "after", ["d"], kind="Normal", treatment="obs")
    if family in ("general", "brute") and rng.random() < 0.3:
        spec.irrelevant = rng.choice(("prior", "enum", "plate"))


def _draw_global_extras(rng, spec, family):
    if family in ("gauss", "brute", "twin"):
        return
    latents = [s for s in spec.latents() if s.level in ("global", "inner", "outer")]
    if latents and rng.random() < 0.3:
        parent = rng.choice(latents)
        spec.factors.append((f"f_{parent.name}", parent.name, _r(rng, -0.8, 0.8)))
    if rng.random() < 0.15:
        spec.model_scale = rng.choice((0.5, 2.0))
    guided = [
        s for s in spec.latents() if s.level == "global" and s.treatment in ("guide", "delta", "nonfact")
    ]
    # (a model-wide scale with a guide factor is a tempering, which TraceEnum_ELBO does not share)
    if guided and rng.random() < 0.2 and not (family == "enum" and spec.model_scale is not None):
        spec.guide_factor = (rng.choice(guided).name, _r(rng, -0.8, 0.8))
    if family == "enum":
        for site in spec.sites:
            site.learn = rng.random() < 0.5


def _draw_options(rng, spec, family):
    o = spec.options
    o["num_samples"] = rng.choice((1, 2, 3, 4, 8)) if family != "brute" else rng.choice((1, 2, 3))
    if family == "gauss":
        o["num_samples"] = rng.choice((2, 4))
    if family == "general" and any(s.numbers["sd"] < 0.05 for s in spec.latents()):
        o["num_samples"] = 8
    o["proposal"] = rng.choice(("mixture", "permutation", "diagonal"))
    if family == "gauss" and o["proposal"] == "diagonal":
        # diagonal scores particle j of a latent by p(z^j | parent^j) only: a combination with another
        # parent particle has weight p(z^j | parent^i) / p(z^j | parent^j), whose tail is too heavy for
        # a sample mean (unbiased, but no usable standard error)
        o["proposal"] = rng.choice(("mixture", "permutation"))
    if family == "general" and rng.random() < 0.3:
        continuous = [
            s
            for s in spec.latents()
            if s.kind in CONTINUOUS and s.treatment in ("guide", "auto", "nonfact") and s.level != "chain"
        ]
        if continuous:
            choices = ("AutoNormal", "AutoMultivariateNormal") + (("AutoDelta",) if family != "gauss" else ())
            spec.autoguide = rng.choice(choices)
            for s in continuous:
                s.treatment = "auto"
    if family == "budget" and rng.random() < 0.85:
        _draw_budget_autoguide(rng, spec)
    if family == "enum" and rng.random() < 0.3:
        deltas = [s for s in spec.latents() if s.treatment == "delta" and s.level != "chain"]
        if deltas:
            spec.autoguide = "AutoDelta"
            for s in deltas:
                s.treatment = "auto"
    hand_plated = any(
        s.level in ("inner", "outer") and s.treatment in ("guide", "nonfact", "delta", "genum")
        for s in spec.latents()
    )
    if spec.autoguide is not None and (hand_plated or any(p.batch != p.size for p in spec.plates)):
        for s in spec.latents():  # AutoGuides subsample only by size, through create_plates: keep them global
            outside_plates = family == "chain" and s.level in ("chain", "after")
            if s.treatment == "auto" and s.level != "global" and not outside_plates:
                s.treatment = "guide" if family != "enum" else "delta"
    if not any(s.treatment == "auto" for s in spec.latents()):
        spec.autoguide = None
    if spec.autoguide is None:
        for s in spec.latents():
            if s.treatment == "auto":
                s.treatment = "guide"
    o["max_factor_bytes"] = (
        rng.choice((8, 16, 64, 256)) if family != "budget" else rng.choice((8, 16, 32, 64))
    )
    if family == "budget":
        o["num_samples"] = rng.choice((2, 3, 4, 4, 8, 8, 16))
    o["variance_reduction"] = rng.choice(("stl", "dregs"))
    o["per_site_K"] = rng.random() < 0.2 and o["proposal"] == "mixture"
    if o["per_site_K"]:  # infer={"num_samples": K_i} on some sampled sites
        for site in spec.latents():
            if site.treatment in ("guide", "nonfact", "prior") and rng.random() < 0.5:
                site.numbers["K"] = rng.choice((1, 2, 3, 5))


def _draw_budget_autoguide(rng: random.Random, spec: Spec) -> None:
    """An AutoGuide for the budget family's continuous latents, the chain's and the one after it too."""
    continuous = [
        s for s in spec.latents() if s.kind in CONTINUOUS and s.treatment in ("guide", "auto", "nonfact")
    ]
    if continuous:
        spec.autoguide = rng.choice(("AutoNormal", "AutoNormal", "AutoDelta", "AutoDiagonalNormal"))
        for s in continuous:
            s.treatment = "auto"


# --------------------------------------------------------------------------- #
# the chain family
# --------------------------------------------------------------------------- #


def _draw_chain_family(rng: random.Random, seed: int) -> Optional[Spec]:
    """
    A chain family case: 0-2 globals, a plate a third of the time, a chain (long a fifth of the
    time) and its observations, under AutoGuides and hand-written guides. Linear-Gaussian cases
    draw their kinds, plates and data as the gauss family does (``style``).
    """
    gaussian = rng.random() < 0.3
    style = "gauss" if gaussian else "chain"
    sites: list[Site] = []
    spec = Spec(seed=seed, family="chain", sites=sites, linear_gaussian=gaussian)

    def add(name, level, parents, kind=None, discrete_only=False, treatment=None):
        kind = kind or _pick_kind(rng, style, discrete_only)
        treatment = treatment or _chain_family_treatment(rng, gaussian, kind)
        site = Site(name, kind, level, list(parents), treatment, _numbers(rng, kind, False))
        sites.append(site)
        return site

    for g in range(rng.choice((0, 1, 1, 2))):
        earlier = [s.name for s in sites]
        add(f"g{g}", "global", rng.sample(earlier, k=min(len(earlier), rng.choice((0, 1)))))
    global_names = [s.name for s in sites]
    if rng.random() < 0.35:
        _draw_plates(rng, spec, style, False, False, add, global_names)
    _draw_family_chain(rng, spec, gaussian, add, global_names)
    _draw_chain_autoguide(rng, spec)
    _draw_options(rng, spec, "chain")
    if gaussian:  # a long chain's log P_TMC spreads as sqrt(T / K): K=16 keeps its sd near 0.5
        spec.options["num_samples"] = rng.choice((4, 8)) if spec.chain.length <= 64 else 16
        if spec.chain.length > 8:  # (and no chain of 1-5 particles a step: no usable mean)
            spec.site("h").numbers.pop("K", None)
        if spec.options["proposal"] == "diagonal":  # (see _draw_options: no usable standard error)
            spec.options["proposal"] = rng.choice(("mixture", "permutation"))
    _fix_invalid(spec)
    if gaussian:
        _prior_predictive_data(rng, spec)
        _posterior_like_guides(rng, spec)
    if spec.autoguide in ("AutoMultivariateNormal", "AutoDiagonalNormal") and any(
        p.batch != p.size for p in spec.plates
    ):
        spec.autoguide = "AutoNormal"
    _draw_auto_init(rng, spec)
    spec.features = sorted(features_of(spec))
    return spec


def _chain_family_treatment(rng: random.Random, gaussian: bool, kind: str) -> str:
    """How the chain family's guide treats a latent: AutoGuides often, hand-written guides beside them."""
    if gaussian:  # the AutoGuide's only on the chain: its one init_scale then fits (as the chain's)
        return rng.choice(("guide", "guide", "prior", "nonfact"))
    if kind in DISCRETE:
        return rng.choice(("enum", "guide", "prior", "genum"))
    return rng.choice(("auto", "auto", "guide", "delta", "prior", "nonfact"))


def _draw_family_chain(rng, spec, gaussian, add, global_names):
    """The chain family's chain: stable (``|c1| + |c2| < 1``), so that long chains stay of order one."""
    long = rng.random() < CHAIN_LONG_FRACTION
    length = rng.randint(*CHAIN_LONG) if long else rng.choice((1, 2, 3, 4, 6, 8, 12, 20))
    history = rng.choice((1, 2))
    kind = "Normal" if gaussian else rng.choice(("Normal",) * 6 + ("Categorical", "Bernoulli"))
    parents = ["prev1"] + (["prev2"] if history == 2 else [])
    reads = rng.sample(global_names, k=min(len(global_names), rng.choice((0, 1, 1))))
    treatment = (
        rng.choice(("auto", "auto", "auto", "guide", "guide", "nonfact", "delta", "prior"))
        if kind == "Normal"
        else rng.choice(("enum", "guide", "guide", "prior"))
    )
    if gaussian:
        # for a usable mean of P_TMC / p(x): no Delta (its estimate is of p(x, z), not p(x)), the
        # prior as proposal only on short chains, and a long chain reads no global (a mean-field
        # guide misses the global's coupling to every step: the ratio's tail grows with T)
        if treatment == "delta" or treatment == "prior" and length > 4:
            treatment = "guide"
        if long:
            reads = []
    parents += reads
    h = add("h", "chain", parents, kind=kind, treatment=treatment)
    c1 = _r(rng, -0.9, 0.9)
    h.numbers["c1"] = c1
    h.numbers["c2"] = round(rng.uniform(-1, 1) * (0.95 - abs(c1)), 2)
    # a long chain needs the model's pyro.markov (its latents hold a dim each otherwise), and a
    # guide that couples its steps needs its own
    chain = Chain(length, history, markov_model=long or rng.random() < 0.8, markov_guide=rng.random() < 0.6)
    if long and treatment == "nonfact":
        chain.markov_guide = True
    spec.chain = chain
    extra = [] if gaussian else rng.sample(global_names, k=min(len(global_names), rng.choice((0, 0, 1))))
    add("y", "chain", ["h"] + extra, kind="Normal", treatment="obs")
    if rng.random() < 0.35:
        add(
            "d",
            "after",
            ["h"],
            kind="Normal" if gaussian else rng.choice(("Normal", "Normal", "Categorical")),
        )
        add("yd", "after", ["d"], kind="Normal", treatment="obs")
    if not gaussian and rng.random() < 0.2:
        spec.irrelevant = rng.choice(("prior", "enum", "plate"))


def _draw_chain_autoguide(rng: random.Random, spec: Spec) -> None:
    """The AutoGuide of the chain family's "auto" latents (no AutoDelta in linear-Gaussian cases: no p(x))."""
    if not any(s.treatment == "auto" for s in spec.latents()):
        return
    long = spec.chain.length > 64
    if spec.linear_gaussian:  # one joint site over a long chain: a ratio too heavy-tailed to average
        choices = ("AutoNormal",) * 3 + (("AutoDiagonalNormal",) if not long else ())
    else:
        choices = ("AutoNormal",) * 3 + ("AutoDelta", "AutoDiagonalNormal")
    spec.autoguide = rng.choice(choices)


def _draw_auto_init(rng: random.Random, spec: Spec) -> None:
    """
    The AutoGuide's ``init_scale`` and initial locations: in linear-Gaussian cases those of the
    prior-like guides (broader than each latent's prior marginal, :func:`_prior_like_guides`),
    else a drawn scale and ``init_to_feasible``'s locations (0 for a real site).
    """
    if spec.autoguide is None:
        return
    autos = [s for s in spec.latents() if s.treatment == "auto"]
    if not spec.linear_gaussian:
        spec.auto_init = {"scale": rng.choice((0.1, 0.5, 1.0)), "locs": {}}
        return
    locs = {}
    for site in autos:
        if site.level == "chain":
            locs.update({f"{site.name}_{t}": v for t, v in enumerate(site.numbers["glocs"])})
        elif site.level in ("global", "after"):
            locs[site.name] = site.numbers["gloc"]
    scale = max(s.numbers["gscale"] for s in autos)
    spec.auto_init = {"scale": float(scale), "locs": locs}


def _fix_invalid(spec: Spec) -> None:
    """Keep the pair valid: what a treatment needs of its site and of its parents."""
    names = {s.name: s for s in spec.sites}
    for site in spec.latents():
        kind_parents = [names[p] for p in site.parents if p in names]
        if site.treatment == "nonfact":
            guided = [p for p in kind_parents if p.treatment in ("guide", "nonfact") and p.kind == "Normal"]
            if site.kind != "Normal" or not guided or site.level == "chain":
                site.treatment = "guide" if site.level != "chain" or site.kind != "Normal" else "nonfact"
            else:
                site.numbers["guide_parent"] = guided[0].name
        if site.treatment == "genum" and (
            site.kind not in DISCRETE or site.level in ("chain", "after", "outer")
        ):
            site.treatment = "enum" if site.kind in DISCRETE else "guide"
        if site.treatment == "enum" and site.kind not in DISCRETE:
            site.treatment = "delta"
        if site.treatment == "delta" and site.kind in DISCRETE:
            site.treatment = "enum"
        if site.level == "chain" and site.treatment == "genum":
            site.treatment = "enum"
    if spec.chain is not None:
        h = spec.site("h")
        if h.treatment == "nonfact" and h.kind != "Normal":
            h.treatment = "guide"
        if h.treatment in ("auto",) and spec.family not in ("budget", "chain"):
            h.treatment = "guide"  # AutoGuides do not see markov loops the way we write them
        if spec.chain.length > 1 and h.treatment == "enum" and not spec.chain.markov_model:
            pass  # a plain loop with enumerated states is valid (no recycling)
    if spec.family == "brute":  # brute force knows the proposal of a prior-drawn latent only without parents
        for site in spec.latents():
            if site.treatment == "prior" and site.parents:
                site.treatment = "guide"
    # a model-only (prior) latent whose parent is a sampled or Delta guide latent: fine for TMC
    for site in spec.latents():
        if site.treatment == "auto" and site.level == "chain" and spec.family not in ("budget", "chain"):
            site.treatment = "delta" if spec.family == "enum" else "guide"
    if not any(s.treatment == "auto" for s in spec.latents()):
        spec.autoguide = None
    # TraceEnum_ELBO needs one scale for all enumerated sites
    enumerated_outside_plates = any(
        s.treatment in ("enum", "genum") and s.level in ("global", "chain") for s in spec.latents()
    )
    if spec.family == "enum" and spec.plate_scale is not None and enumerated_outside_plates:
        spec.plate_scale = None


def _num_combinations(spec: Spec) -> int:
    """How many joint assignments brute force lists (sampled: K each, enumerated: its support)."""
    K = spec.options.get("num_samples", 2)
    count = 1
    for site in spec.latents():
        copies = _elements(spec, site)
        if site.treatment in ("enum", "genum"):
            count *= support_size(site.kind) ** copies
        elif site.treatment in ("guide", "prior", "nonfact", "auto"):
            count *= K**copies
    return count


def support_size(kind: str) -> int:
    return {
        "Bernoulli": 2,
        "Binomial": 3,
        "Categorical": NUM_CATEGORIES,
        "OneHotCategorical": NUM_CATEGORIES,
    }[kind]


def _elements(spec: Spec, site: Site) -> int:
    """How many copies of a site there are (plate elements, chain steps)."""
    if site.level == "chain":
        return spec.chain.length
    if site.level == "inner":
        return spec.plates[-1].batch * (spec.plates[0].batch if len(spec.plates) == 2 else 1)
    if site.level == "outer":
        return spec.plates[0].batch
    return 1


def features_of(spec: Spec) -> set:
    """Named features of a spec, for the coverage table."""
    out = {f"family:{spec.family}"}
    for s in spec.sites:
        out.add(f"site:{s.kind}")
        if not s.observed:
            out.add(f"guide:{s.treatment}")
        if s.mask is not None:
            out.add("mask")
        if s.parents and any(
            spec.site(p).kind in ("Categorical",) for p in s.parents if p not in ("prev1", "prev2")
        ):
            out.add("vindex")
    if len(spec.plates) == 2:
        out.add("plate:nested")
    for p in spec.plates:
        if p.subsample_size is not None:
            out.add("plate:subsample_size")
        if p.subsample is not None:
            out.add("plate:subsample_indices")
        if p.batch == 1:
            out.add("plate:batch1")
    if spec.chain is not None:
        out.add(f"markov:history{spec.chain.history}")
        if spec.chain.markov_guide and not spec.chain.markov_model:
            out.add("markov:guide_only")
        if not spec.chain.markov_guide and spec.chain.markov_model:
            out.add("markov:model_only")
        if any(s.level == "after" for s in spec.sites):
            out.add("markov:latent_after_loop")
    if spec.autoguide:
        out.add(f"guide:{spec.autoguide}")
        if any(s.treatment == "auto" and s.level == "chain" for s in spec.sites):
            out.add("guide:auto_chain")
    if spec.chain is not None and any(
        p not in ("prev1", "prev2", "h") for s in spec.sites if s.level == "chain" for p in s.parents
    ):
        out.add("markov:reads_global")
    if any(s.treatment == "nonfact" or (s.treatment == "prior" and s.parents) for s in spec.sites):
        out.add(f"proposal:{spec.options['proposal']}")
    if spec.plate_scale is not None:
        out.add("scale:plate")
    if spec.model_scale is not None:
        out.add("scale:model")
    if spec.factors:
        out.add("factor")
    if spec.guide_factor is not None:
        out.add("factor:guide")
    if spec.irrelevant:
        out.add(f"irrelevant:{spec.irrelevant}")
    if any("K" in s.numbers for s in spec.latents()):
        out.add("per_site_num_samples")
    if any(s.numbers["sd"] < 0.05 for s in spec.latents() if s.kind == "Normal"):
        out.add("stiff")
    if spec.family == "chain":
        out |= _chain_family_features(spec)
    return out


def _chain_family_features(spec: Spec) -> set:
    """The chain family's own features (others' feature lists stay as they were)."""
    out = set()
    if spec.chain.length > 64:
        out.add("chain:long")
    if spec.linear_gaussian:
        out.add("chain:linear_gaussian")
        if spec.chain.length > 64:
            out.add("chain:long_linear_gaussian")  # the exact log p(x) across recycled dims
    h = spec.site("h")
    if h.treatment == "auto":
        out.add(f"chain:{spec.autoguide}")
        if spec.chain.length > 64:
            out.add(f"chain:long_{spec.autoguide}")
        if guide_sites(spec):
            out.add("chain:auto_beside_hand")
    elif h.treatment in ("guide", "nonfact", "delta"):
        out.add("chain:hand_markov" if spec.chain.markov_guide else "chain:hand_plain_loop")
        if h.treatment == "nonfact" or any(s.numbers.get("guide_parent") == "h" for s in guide_sites(spec)):
            out.add("chain:guide_reads_chain")  # long and in pyro.markov: its plain loop is refused
        if spec.chain.length > 64:
            out.add("chain:long_hand_markov" if spec.chain.markov_guide else "chain:long_hand_plain_loop")
    return out


# --------------------------------------------------------------------------- #
# rendering
# --------------------------------------------------------------------------- #


def _t(value) -> str:
    """A tensor literal."""
    return f"torch.tensor({value!r})"


class _Lines:
    def __init__(self):
        self.lines: list[str] = []

    def add(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)


def _index(spec: Spec, level: str) -> str:
    """How a full-plate tensor is indexed at a level (data and per-element guide parameters)."""
    if level == "inner" and len(spec.plates) == 2:
        return "[i_outer.unsqueeze(-1), i_data]"
    if level == "inner":
        return "[i_data]"
    if level == "outer":
        return "[i_outer]"
    return ""


def _plate_shape(spec: Spec, level: str) -> list[int]:
    if level == "inner" and len(spec.plates) == 2:
        return [spec.plates[0].size, spec.plates[1].size]
    if level == "inner":
        return [spec.plates[-1].size]
    if level == "outer":
        return [spec.plates[0].size, 1]
    return []


def _var(name: str) -> str:
    return {"prev1": "prev1", "prev2": "prev2"}.get(name, name)


def _signal(parent: Site, var: str) -> str:
    """A batch-shaped number that a child reads from its parent's value."""
    n = parent.numbers
    if parent.kind in ("Normal", "Gamma", "Bernoulli", "Binomial"):
        return f"{n['coef']} * {var}"
    if parent.kind == "Categorical":
        return f"Vindex({_t(n['table'])})[..., {var}]"
    return f"({var} * {_t(n['table'])}).sum(-1)"  # OneHotCategorical, Dirichlet: a vector value


def _param(spec: Spec, site: Site, key: str, value, constraint: str = "") -> str:
    if site.learn:
        extra = f", constraint=constraints.{constraint}" if constraint else ""
        return f'pyro.param("{site.name}_{key}", {_t(value)}{extra})'
    return _t(value) if isinstance(value, list) else repr(value)


def _model_dist(spec: Spec, site: Site) -> str:
    """The distribution expression of a model site."""
    n = site.numbers
    names = {s.name: s for s in spec.sites}
    if site.level == "chain" and site.name == "h":
        return _chain_dist(spec, site)
    signals = [_signal(names[p], _var(p)) for p in site.parents if p in names]
    s = " + ".join(signals)
    kind = site.kind
    if kind == "Normal":
        loc = _param(spec, site, "bias", n["bias"])
        return f"dist.Normal({loc}{' + ' + s if s else ''}, {n['sd']})"
    if kind == "Gamma":
        if not s:
            return f"dist.Gamma({n['conc']}, {_param(spec, site, 'rate', n['rate'], 'positive')})"
        return f"dist.Gamma({n['conc']}, torch.exp(0.3 * ({s})))"
    if kind == "Dirichlet":
        conc = _t([n["conc"]] * NUM_CATEGORIES)
        if not s:
            return f"dist.Dirichlet({conc})"
        return f"dist.Dirichlet({conc} + torch.nn.functional.softplus({s}).unsqueeze(-1))"
    if kind in ("Bernoulli", "Binomial"):
        head = "dist.Bernoulli(" if kind == "Bernoulli" else "dist.Binomial(2, "
        if not s:
            return f"{head}{_param(spec, site, 'p', n['p'], 'unit_interval')})"
        return f"{head}logits={n['bias']} + {s})"
    head = "dist.Categorical" if kind == "Categorical" else "dist.OneHotCategorical"
    parents = [names[p] for p in site.parents if p in names]
    if not parents:
        return f"{head}({_param(spec, site, 'probs', n['probs'], 'simplex')})"
    if len(parents) == 1 and parents[0].kind == "Categorical":
        return f"{head}(Vindex({_t(n['trans'])})[..., {parents[0].name}, :])"
    if len(parents) == 1 and parents[0].kind == "Dirichlet":
        return f"{head}({parents[0].name})"
    return f"{head}(logits={_t(n['w'])} + ({s}).unsqueeze(-1) * {_t(n['table'])})"


def _chain_dist(spec: Spec, site: Site) -> str:
    n = site.numbers
    names = {s.name: s for s in spec.sites}
    extra = [_signal(names[p], p) for p in site.parents if p in names]
    extra_s = "".join(f" + {e}" for e in extra)
    two = "prev2" in site.parents
    if site.kind == "Normal":
        terms = f"(0.0 if prev1 is None else {n['c1']} * prev1)"
        if two:
            terms += f" + (0.0 if prev2 is None else {n['c2']} * prev2)"
        return f"dist.Normal({_param(spec, site, 'bias', n['bias'])} + {terms}{extra_s}, {n['sd']})"
    if site.kind == "Bernoulli":
        terms = f"(0.0 if prev1 is None else {n['c1']} * prev1)"
        if two:
            terms += f" + (0.0 if prev2 is None else {n['c2']} * prev2)"
        return f"dist.Bernoulli(logits={n['bias']} + {terms}{extra_s})"
    init = _param(spec, site, "probs", n["probs"], "simplex")
    expr = f"{init} if prev1 is None else Vindex({_t(n['trans'])})[..., prev1, :]"
    if two:
        expr = (
            f"{init} if prev1 is None else Vindex({_t(n['trans'])})[..., prev1, :] if prev2 is None else "
            f"Vindex({_t(n['trans2'])})[..., prev2, prev1, :]"
        )
    if extra:
        return (
            f"dist.Categorical(logits=({expr}).log(){extra_s and ' + (' + extra_s[3:] + ').unsqueeze(-1)'})"
        )
    return f"dist.Categorical({expr})"


def _infer(site: Site, spec: Spec, role: str) -> str:
    parts = []
    if role == "model" and site.treatment == "enum":
        parts.append('"enumerate": "parallel"')
    if role == "guide" and site.treatment == "genum":
        parts.append('"enumerate": "parallel"')
    k = site.numbers.get("K")
    if (
        k is not None
        and site.treatment in ("guide", "nonfact", "prior")
        and (role == "guide") == (site.treatment != "prior")
    ):
        parts.append(f'"num_samples": {k}')
    if not parts:
        return ""
    if parts == ['"enumerate": "parallel"']:
        return ", infer=ENUM"
    return ", infer={" + ", ".join(parts) + "}"


def _data_value(spec: Spec, site: Site, rng: random.Random):
    """The observed value of an observation site, a nested list over its plate (full size)."""
    shape = _plate_shape(spec, site.level) if site.level in ("inner", "outer") else []
    same = site.numbers.get("same_data", False)
    first = [None]

    def one():
        if same and first[0] is not None:
            return first[0]
        v = float(rng.random() < 0.5) if site.kind == "Bernoulli" else round(rng.gauss(0.5, 1.0), 2)
        first[0] = v
        return v

    def build(dims):
        if not dims:
            return one()
        return [build(dims[1:]) for _ in range(dims[0])]

    return build([d for d in shape if d != 1] if site.level == "outer" else shape)


def render(spec: Spec) -> str:
    """Python source defining ``model()`` and ``guide()`` (and the data they read)."""
    rng = random.Random(spec.seed * 7919 + 1)
    head = [PRELUDE]
    for site in spec.sites:
        if site.observed and "data" in site.numbers:
            prefix = "Y" if site.level == "chain" else "X"
            head.append(f"{prefix}_{site.name.upper()} = {_t(site.numbers['data'])}")
        elif site.observed and site.level in ("inner", "outer"):
            head.append(f"X_{site.name.upper()} = {_t(_data_value(spec, site, rng))}")
        elif site.observed and site.level == "chain":
            head.append(
                f"Y_{site.name.upper()} = "
                f"{_t([round(rng.gauss(0.3, 1.0), 2) for _ in range(spec.chain.length)])}"
            )
        elif site.observed:
            head.append(f"X_{site.name.upper()} = {_t(round(rng.gauss(0.4, 1.0), 2))}")
        if site.mask is not None:
            shape = _plate_shape(spec, site.level)
            mask = site.mask
            if len(shape) == 2:
                mask = [mask[r * shape[1] : (r + 1) * shape[1]] for r in range(shape[0])]
            head.append(f"MASK_{site.name.upper()} = {_t(mask)}")
    body = _render_model(spec)
    guide = _render_guide(spec)
    return "\n".join(head) + "\n\n\n" + body + "\n\n\n" + guide + "\n"


def _plate_open(spec: Spec, plate: Plate, role: str) -> str:
    args = f'"{plate.name}", {plate.size}'
    if plate.dim == -2 or len(spec.plates) == 2:
        args += f", dim={plate.dim}"
    if plate.subsample_size is not None:
        args += f", subsample_size={plate.subsample_size}"
    if plate.subsample is not None:
        args += f", subsample={_t(plate.subsample)}"
    return f"with pyro.plate({args}) as i_{plate.name}:"


def _sample_line(spec: Spec, site: Site) -> str:
    if site.observed:
        if site.level == "chain":
            obs = f"Y_{site.name.upper()}[t]"
        elif site.level in ("inner", "outer"):
            obs = f"X_{site.name.upper()}{_index(spec, site.level)}"
            if site.level == "outer":
                obs += ".unsqueeze(-1)"
        else:
            obs = f"X_{site.name.upper()}"
        name = f'f"{site.name}_{{t}}"' if site.level == "chain" else f'"{site.name}"'
        return f"pyro.sample({name}, {_model_dist(spec, site)}, obs={obs})"
    name = f'f"{site.name}_{{t}}"' if site.level == "chain" else f'"{site.name}"'
    return f"{site.name} = pyro.sample({name}, {_model_dist(spec, site)}{_infer(site, spec, 'model')})"


def _render_model(spec: Spec) -> str:
    out = _Lines()
    out.add(0, "def model():")
    depth = 1
    if spec.model_scale is not None:
        out.add(depth, f"with poutine.scale(scale={spec.model_scale}):")
        depth += 1
    start = len(out.lines)
    for site in spec.sites:
        if site.level == "global":
            out.add(depth, _sample_line(spec, site))
    _render_factors(spec, out, depth, "global")
    if spec.plates:
        _render_model_plates(spec, out, depth)
    if spec.irrelevant is not None:
        _render_irrelevant(spec, out, depth)
    if spec.chain is not None:
        _render_model_chain(spec, out, depth)
    if len(out.lines) == start:
        out.add(depth, "pass")
    return "\n".join(out.lines)


def _render_irrelevant(spec: Spec, out: _Lines, depth: int) -> None:
    kind = spec.irrelevant
    if kind == "prior":
        out.add(depth, 'pyro.sample("m", dist.Normal(0.0, 1.0))  # nothing depends on m')
    elif kind == "enum":
        out.add(
            depth, 'pyro.sample("m", dist.Categorical(torch.ones(3) / 3), infer=ENUM)  # nothing depends on m'
        )
    elif kind == "plate":
        dim = f", dim={-spec.max_plate_nesting}" if spec.max_plate_nesting > 1 else ""
        out.add(depth, f'with pyro.plate("m_plate", 2{dim}):')
        out.add(depth + 1, 'pyro.sample("m", dist.Normal(0.0, 1.0))  # nothing depends on m')


def _render_factors(spec: Spec, out: _Lines, depth: int, level: str) -> None:
    names = {s.name: s for s in spec.sites}
    for fname, parent, coef in spec.factors:
        site = names[parent]
        if site.level == level:
            out.add(depth, f'pyro.factor("{fname}", {coef} * ({_signal(site, site.name)}))')


def _render_model_plates(spec: Spec, out: _Lines, depth: int) -> None:
    levels = ["outer", "inner"] if len(spec.plates) == 2 else ["inner"]
    for plate, level in zip(spec.plates, levels):
        out.add(depth, _plate_open(spec, plate, "model"))
        depth += 1
        if spec.plate_scale is not None and plate is spec.plates[0]:
            out.add(depth, f"with poutine.scale(scale={spec.plate_scale}):")
            depth += 1
        for site in spec.sites:
            if site.level != level:
                continue
            if site.mask is not None:
                out.add(depth, f"with poutine.mask(mask=MASK_{site.name.upper()}{_index(spec, level)}):")
                out.add(depth + 1, _sample_line(spec, site))
            else:
                out.add(depth, _sample_line(spec, site))
        _render_factors(spec, out, depth, level)


def _render_model_chain(spec: Spec, out: _Lines, depth: int) -> None:
    chain = spec.chain
    loop = _loop(chain, chain.markov_model)
    out.add(depth, "prev1 = prev2 = None")
    out.add(depth, f"for t in {loop}:")
    for site in spec.sites:
        if site.level == "chain":
            out.add(depth + 1, _sample_line(spec, site))
    out.add(depth + 1, "prev1, prev2 = h, prev1")
    for site in spec.sites:
        if site.level == "after":
            out.add(depth, _sample_line(spec, site))  # h is the chain's last state


def _loop(chain: Chain, markov: bool) -> str:
    if not markov:
        return f"range({chain.length})"
    history = "" if chain.history == 1 else f", history={chain.history}"
    return f"pyro.markov(range({chain.length}){history})"


# -- the guide ------------------------------------------------------------------------


def _guide_dist(spec: Spec, site: Site) -> str:
    """The hand-written guide's distribution for a latent (factorised unless ``nonfact``)."""
    n = site.numbers
    idx = _index(spec, site.level)
    shape = _plate_shape(spec, site.level)
    name = site.name

    def per_element(value, event=None):
        """A parameter over the plate's elements (the same value in each element: twins need it)."""
        full = value
        for size in reversed(shape):
            full = [full] * size
        return full

    def param(key, value, constraint=""):
        extra = f", constraint=constraints.{constraint}" if constraint else ""
        init = _t(per_element(value)) if shape else _t(value)
        return f'pyro.param("q_{name}_{key}", {init}{extra}){idx}'

    if site.level == "chain":
        return _guide_chain_dist(spec, site)
    if site.treatment == "delta":
        if site.kind == "Dirichlet":
            simplex = _probs(random.Random(len(name)), NUM_CATEGORIES)
            return f"dist.Delta({param('loc', simplex, 'simplex')}, event_dim=1)"
        if site.kind == "Gamma":
            return f"dist.Delta({param('loc', round(n['rate'] + 0.3, 2), 'positive')})"
        return f"dist.Delta({param('loc', round(n['gloc'], 2))})"
    kind = site.kind
    if kind == "Normal":
        loc = param("loc", n["gloc"])
        if site.treatment == "nonfact":
            loc += f" + {n['gcoef']} * {n['guide_parent']}"
        return f"dist.Normal({loc}, {param('scale', n['gscale'], 'positive')})"
    if kind == "Gamma":
        concentration = param("conc", n["conc"] + 1.0, "positive")
        return f"dist.Gamma({concentration}, {param('rate', n['rate'], 'positive')})"
    if kind == "Dirichlet":
        return f"dist.Dirichlet({param('conc', [n['conc']] * NUM_CATEGORIES, 'positive')})"
    if kind == "Bernoulli":
        return f"dist.Bernoulli({param('p', n['p'], 'unit_interval')})"
    if kind == "Binomial":
        return f"dist.Binomial(2, {param('p', n['p'], 'unit_interval')})"
    head = "dist.Categorical" if kind == "Categorical" else "dist.OneHotCategorical"
    return f"{head}({param('probs', n['probs'], 'simplex')})"


def _guide_chain_dist(spec: Spec, site: Site) -> str:
    n = site.numbers
    T = spec.chain.length
    locs = _t(n.get("glocs") or [round(n["gloc"] + 0.1 * t, 2) for t in range(T)])
    if site.treatment == "delta":
        return f'dist.Delta(pyro.param("q_h_loc", {locs})[t])'
    if site.kind == "Normal":
        loc = f'pyro.param("q_h_loc", {locs})[t]'
        if site.treatment == "nonfact":
            loc += f" + (0.0 if prev1 is None else {n['gcoef']} * prev1)"
        scale = 0.3 if "stiff" in spec.features or n["sd"] < 0.05 else n["gscale"]
        return f"dist.Normal({loc}, {scale})"
    if site.kind == "Bernoulli":
        p = f'pyro.param("q_h_p", {_t([n["p"]] * T)}, constraint=constraints.unit_interval)'
        return f"dist.Bernoulli({p}[t])"
    probs = f'pyro.param("q_h_probs", {_t([n["probs"]] * T)}, constraint=constraints.simplex)'
    return f"dist.Categorical({probs}[t])"


def _guide_line(spec: Spec, site: Site) -> str:
    return f'{site.name} = pyro.sample("{site.name}", {_guide_dist(spec, site)}{_infer(site, spec, "guide")})'


def guide_sites(spec: Spec) -> list[Site]:
    """The latents the hand-written guide samples (AutoGuide sites are the AutoGuide's)."""
    return [s for s in spec.latents() if s.treatment in ("guide", "nonfact", "delta", "genum")]


def _render_guide(spec: Spec) -> str:
    out = _Lines()
    auto_names = [
        name
        for s in spec.latents()
        if s.treatment == "auto"
        for name in ([f"{s.name}_{t}" for t in range(spec.chain.length)] if s.level == "chain" else [s.name])
    ]
    if spec.autoguide and spec.auto_init is not None:
        _render_initialised_autoguide(spec, out)
    elif spec.autoguide:
        out.add(0, "def make_autoguide():")
        scale = ", init_scale=1.5" if spec.family == "gauss" and spec.autoguide != "AutoDelta" else ""
        out.add(
            1,
            f"return {spec.autoguide}(poutine.block(model, expose={auto_names!r}), "
            f"init_loc_fn=init_to_feasible{scale})",
        )
        out.add(0, "")
        out.add(0, "")
    out.add(0, "def guide():" if not spec.autoguide else "def hand_guide():")
    depth = 1
    mine = guide_sites(spec)
    start = len(out.lines)
    for site in mine:
        if site.level == "global":
            out.add(depth, _guide_line(spec, site))
    if spec.guide_factor is not None and spec.guide_factor[0] in [s.name for s in mine]:
        name, coef = spec.guide_factor
        rsample = spec.site(name).kind in CONTINUOUS
        out.add(
            depth,
            f'pyro.factor("gf_{name}", {coef} * ({_signal(spec.site(name), name)}), has_rsample={rsample})',
        )
    levels = ["outer", "inner"] if len(spec.plates) == 2 else ["inner"]
    # the guide opens the plates when it samples in them, or when they subsample by size (one minibatch)
    plated = [s for s in mine if s.level in ("inner", "outer")]
    if spec.plates and (plated or any(p.subsample_size for p in spec.plates)):
        d = depth
        for plate, level in zip(spec.plates, levels):
            out.add(d, _plate_open(spec, plate, "guide"))
            d += 1
            inside = [s for s in plated if s.level == level]
            for site in inside:
                out.add(
                    d,
                    _guide_line(spec, site),
                )
            if not inside:
                out.add(d, "pass")
    chain_sites = [s for s in mine if s.level == "chain"]
    if chain_sites and not spec.chain_guide_last:
        _render_guide_chain(spec, out, depth, chain_sites)
    for site in mine:
        if site.level == "after":
            out.add(
                depth,
                _guide_line(spec, site),
            )
    if chain_sites and spec.chain_guide_last and not spec.autoguide:
        _render_guide_chain(spec, out, depth, chain_sites)
    if len(out.lines) == start:
        out.add(depth, "pass")
    if spec.autoguide:
        out.add(0, "")
        out.add(0, "")
        last = chain_sites and spec.chain_guide_last
        if last:  # the chain's draws after the AutoGuide's, as an AutoGuide over it makes them
            out.add(0, "def hand_chain():")
            _render_guide_chain(spec, out, 1, chain_sites)
            out.add(0, "")
            out.add(0, "")
        out.add(0, "def make_guide():")
        out.add(1, "autoguide = make_autoguide()")
        out.add(0, "")
        out.add(1, "def guide():")
        out.add(2, "hand_guide()")
        out.add(2, "autoguide()")
        if last:
            out.add(2, "hand_chain()")
        out.add(0, "")
        out.add(1, "return guide")
    return "\n".join(out.lines)


def _render_guide_chain(spec: Spec, out: _Lines, depth: int, chain_sites: list[Site]) -> None:
    out.add(depth, "prev1 = None")
    out.add(depth, f"for t in {_loop(spec.chain, spec.chain.markov_guide)}:")
    for site in chain_sites:
        out.add(
            depth + 1,
            f'h = pyro.sample(f"h_{{t}}", {_guide_dist(spec, site)}{_infer(site, spec, "guide")})',
        )
    out.add(depth + 1, "prev1 = h")


def _render_initialised_autoguide(spec: Spec, out: _Lines) -> None:
    """The chain family's AutoGuide: its sites (a chain's as a comprehension), scale and initial locations."""
    names = [s.name for s in spec.latents() if s.treatment == "auto" and s.level != "chain"]
    chain = [s.name for s in spec.latents() if s.treatment == "auto" and s.level == "chain"]
    expose = repr(names) + "".join(f' + [f"{c}_{{t}}" for t in range({spec.chain.length})]' for c in chain)
    locs = spec.auto_init["locs"]
    out.add(0, "def make_autoguide():")
    if locs:
        out.add(1, "from pyro.infer.autoguide import init_to_value")
        out.add(0, "")
        values = {name: v for name, v in locs.items() if not any(name.startswith(f"{c}_") for c in chain)}
        out.add(1, f"locs = {values!r}")
        for c in chain:
            steps = [locs[f"{c}_{t}"] for t in range(spec.chain.length)]
            out.add(1, f'locs.update({{f"{c}_{{t}}": v for t, v in enumerate({steps!r})}})')
        out.add(1, "values = {name: torch.tensor(v) for name, v in locs.items()}")
        out.add(1, "init_loc_fn = init_to_value(values=values, fallback=init_to_feasible)")
    else:
        out.add(1, "init_loc_fn = init_to_feasible")
    scale = f", init_scale={spec.auto_init['scale']}" if spec.autoguide != "AutoDelta" else ""
    out.add(
        1, f"return {spec.autoguide}(poutine.block(model, expose={expose}), init_loc_fn=init_loc_fn{scale})"
    )
    out.add(0, "")
    out.add(0, "")


# --------------------------------------------------------------------------- #
# cases
# --------------------------------------------------------------------------- #


@dataclass
class Case:
    """A spec with its source; :meth:`build` executes the source (in the current default dtype)."""

    spec: Spec

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def source(self) -> str:
        return render(self.spec)

    def build(self) -> tuple[object, object]:
        """``(model, guide)``: a fresh guide each call (AutoGuides hold their own state)."""
        namespace: dict[str, object] = {}
        exec(compile(self.source, f"<fuzz case {self.seed}>", "exec"), namespace)
        guide = namespace["make_guide"]() if "make_guide" in namespace else namespace["guide"]
        return namespace["model"], guide

    def variant(self, **changes) -> "Case":
        """A copy of the case with spec fields replaced."""
        spec = copy.deepcopy(self.spec)
        for key, value in changes.items():
            setattr(spec, key, value)
        return Case(spec)

    def describe(self) -> str:
        s = self.spec
        return (
            f"# fuzz case seed={s.seed} family={s.family} max_plate_nesting={s.max_plate_nesting}\n"
            f"# options={s.options}\n# features={', '.join(s.features)}\n{self.source}"
        )


def make_case(seed: int, family: Optional[str] = None) -> Case:
    """The case of a seed (the family drawn from the seed unless given)."""
    return Case(draw_spec(seed, family))
