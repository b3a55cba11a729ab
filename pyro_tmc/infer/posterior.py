"""Reading the posterior that one TMC draw implies.

One draw of particles defines a distribution over all prod_i K_i particle
combinations, with weights proportional to p(x, z)/q(z). We read it with the
autodiff identity (as the alan library does): add a zero *source* tensor ``s_j``
over site j's particles to the log factors; then

    d log P_TMC / d s_j^k = (sum of the weights of the combinations holding particle k) / (sum of all weights)

is the posterior marginal of site j's particle k (per plate element). We chose
this over Pyro's adjoint backends (``torch_marginal`` / ``torch_sample``)
because it runs the very contraction that gives the bound, plate scales and
fused factors included, so the read-outs cannot drift from the estimator.

Joint draws use the same identity sequentially (backward sampling, down the
plate tree: sites in fewer plates first): read the marginal of a site given the
sites already chosen, pick its particle, fix that particle in every factor, move on. Each of
the ``num_draws`` draws conditions its own copy of the factors, held as a batch
(plate) dim, so the draws are vectorised; the cost is one contraction per latent
site.
"""

import math
from collections import OrderedDict
from typing import Callable

import torch

from pyro.distributions import Categorical, Empirical
from pyro.poutine import Trace

from pyro_tmc.estimate.vectorized_markov import unscored_sites
from pyro_tmc.ops.contraction import contract_log_factors
from pyro_tmc.ops.shapes import packed_view
from pyro_tmc.poutine.sites import (
    guide_only_sites,
    is_latent,
    is_point_mass,
    is_point_mass_latent,
    own_particle_dim,
    particle_symbol,
    source_weights,
)

#: the packed symbol of the draws' batch dim (outside opt_einsum's generated range)
DRAWS = "\u2203"


def latent_sites(model_trace: Trace) -> list[str]:
    """Latent sites that carry particles (or enumerated values), in the order they were drawn."""
    return [name for name, site in model_trace.nodes.items() if is_latent(site) and not is_point_mass(site)]


def particle_sites(model_trace: Trace, guide_trace: Trace) -> list[dict]:
    """
    Every site with a particle dim of its own: the model's latents, then the
    guide's auxiliary latents (AutoNormal's ``<name>_unconstrained``), whose
    particles the model's Delta sites carry.
    """
    sites = [model_trace.nodes[name] for name in latent_sites(model_trace)]
    for name in guide_only_sites(model_trace, guide_trace):
        site = guide_trace.nodes[name]
        if is_latent(site) and not is_point_mass(site):
            sites.append(site)
    return sites


def point_mass_sites(model_trace: Trace) -> list[str]:
    """Model latents with no particle dim of their own (Delta guide sites: AutoDelta, AutoNormal)."""
    return [name for name, site in model_trace.nodes.items() if is_point_mass_latent(site)]


def _carried_particle_dims(site, plate_to_symbol: dict[str, str]) -> dict[str, int]:
    """Packed symbol -> dim of each particle dim along which the site's value varies."""
    value = site["value"]
    batch = value.shape[: value.dim() - site["fn"].event_dim]
    plates = set(plate_to_symbol.values())
    return {
        symbol: dim
        for dim, symbol in site["infer"]["_dim_to_symbol"].items()
        if symbol not in plates and -dim <= len(batch) and batch[dim] > 1
    }


def _plate_shape(site) -> tuple[int, ...]:
    """The sizes of the site's plates, at their dims (1 where no plate sits)."""
    frames = [f for f in site["cond_indep_stack"] if f.vectorized]
    shape = [1] * (-min(f.dim for f in frames) if frames else 0)
    for frame in frames:
        shape[frame.dim] = frame.size
    return tuple(shape)


def _plate_slot_symbols(site, plate_to_symbol: dict[str, str]) -> list[str]:
    """The packed symbol at each of the site's plate dims ('' where no plate sits)."""
    frames = [f for f in site["cond_indep_stack"] if f.vectorized]
    symbols = [""] * len(_plate_shape(site))
    for frame in frames:
        symbols[frame.dim] = plate_to_symbol[frame.name]
    return symbols


def _particles_last(site, tensor: torch.Tensor, event_dim: int, particle_dim: int = None) -> torch.Tensor:
    """
    A tensor over the site's particles and plates, reshaped to plates + (K,) + event.
    The particles lie along ``particle_dim``, by default the site's own.
    """
    if particle_dim is None:
        particle_dim = own_particle_dim(site)
    batch_ndim = tensor.dim() - event_dim
    if batch_ndim < -particle_dim:
        tensor = tensor.reshape((1,) * (-particle_dim - batch_ndim) + tensor.shape)
        batch_ndim = -particle_dim
    tensor = tensor.movedim(batch_ndim + particle_dim, batch_ndim - 1)
    plates = _plate_shape(site)
    rest = tensor.shape[: batch_ndim - 1]
    kept = tuple(rest[len(rest) - len(plates) :]) if plates else ()
    tensor = tensor.reshape(kept + tensor.shape[batch_ndim - 1 :])  # drops leading size-1 dims
    return tensor.expand(plates + tensor.shape[len(plates) :])


class ParticleMarginal(Empirical):
    """
    :class:`~pyro.distributions.Empirical` over a site's particles whose
    ``mean`` and ``variance`` are also defined for integer values (enumerated
    Categorical sites): the weighted moments of the values as numbers, which for
    a Bernoulli site are its probability and ``p (1 - p)``, as ``TraceEnum_ELBO``'s
    marginals give. Samples keep the site's dtype, so they still index arrays.
    """

    def _float_samples(self) -> torch.Tensor:
        if self._samples.is_floating_point():
            return self._samples
        return self._samples.to(self._log_weights.dtype)

    @property
    def mean(self) -> torch.Tensor:
        return self._weighted_mean(self._float_samples())

    @property
    def variance(self) -> torch.Tensor:
        samples = self._float_samples()
        deviation = samples - self.mean.unsqueeze(self._aggregation_dim)
        return self._weighted_mean(deviation.pow(2))

    def expectation(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """
        The posterior expectation of ``fn`` of the site's value, ``sum_k w_k fn(z^k)``:
        batch shape + the shape ``fn`` gives each value (elementwise functions keep the
        event shape). QEM reads sufficient statistics this way, e.g. ``E[log z]``.

        :param callable fn: maps the particles (batch shape + (K,) + event shape) to a
            tensor whose leading dims are batch shape + (K,).
        """
        return self._weighted_mean(fn(self._float_samples()))


def compute_marginals(draw) -> "OrderedDict[str, Empirical]":
    """
    :param draw: a :class:`~pyro_tmc.infer.draw.TMCDraw`.
    :returns: for every latent site, its particles weighted by their posterior
        marginal weight, as an :class:`~pyro.distributions.Empirical` batched over
        the site's plates. A Delta site (AutoDelta, AutoNormal) gives the values
        it takes at the particles of the one site it was computed from (its
        auxiliary site), with that site's weights; one that varies with several
        sites' particles is left out.
    """
    return marginals_and_log_estimate(draw)[0]


def marginals_and_log_estimate(draw) -> tuple["OrderedDict[str, Empirical]", torch.Tensor]:
    """
    :func:`compute_marginals` and the draw's ``log P_TMC`` (detached), from one
    contraction: what a loop that both reports the bound and reads the posterior needs.
    """
    model_trace = draw.model_trace
    sites = particle_sites(model_trace, draw.guide_trace)
    sources = draw.sources([site["name"] for site in sites])
    all_weights = {}
    if sources:
        with torch.enable_grad():
            log_estimate = draw.log_estimate(sources)
            all_weights = draw.marginal_weights(log_estimate, sources, retain_graph=False)
    else:
        log_estimate = draw.log_estimate()
    log_weights_of = {}  # particle symbol -> (owner site, plates + (K,) log weights)
    marginals = OrderedDict()
    for site in sites:
        name = site["name"]
        weights = all_weights[name]
        log_weights = _particles_last(site, weights.clamp(min=0).log(), 0)
        symbol = particle_symbol(site)
        # a dim shared by several sites (IWAE's joint samples, a particle group): the weights of
        # the one in the fewest plates, which any Delta carrying that dim can take
        if symbol not in log_weights_of or log_weights.dim() < log_weights_of[symbol].dim():
            log_weights_of[symbol] = log_weights
        if name in model_trace.nodes:
            samples = _particles_last(site, site["value"].detach(), site["fn"].event_dim)
            marginals[name] = ParticleMarginal(samples, log_weights)
    # a vectorized_markov chain's previous steps hold the steps before's particles: no marginal of their own
    # (their values may carry a particle dim that no site's weights are over)
    unscored = unscored_sites(model_trace, draw.guide_trace)
    for name in point_mass_sites(model_trace):
        if name in unscored:
            continue
        marginal = _point_mass_marginal(model_trace.nodes[name], log_weights_of, model_trace.plate_to_symbol)
        if marginal is not None:
            marginals[name] = marginal
    marginals = OrderedDict(
        (name, marginals[name]) for name in model_trace.nodes if name in marginals and name not in unscored
    )
    return marginals, log_estimate.detach()


def _point_mass_marginal(site, log_weights_of, plate_to_symbol):
    """A Delta site's values at its source's particles, with the source's weights (see compute_marginals)."""
    carried = _carried_particle_dims(site, plate_to_symbol)
    plates = _plate_shape(site)
    event_dim = site["fn"].event_dim
    if len(carried) > 1:
        return None
    if not carried:  # one value (AutoDelta): a point mass
        samples = _particles_last(site, site["value"].detach(), event_dim, -1 - len(plates))
        return ParticleMarginal(samples, samples.new_zeros(samples.shape[: len(plates) + 1]))
    ((symbol, dim),) = carried.items()
    samples = _particles_last(site, site["value"].detach(), event_dim, dim)
    log_weights = log_weights_of[symbol]
    extra = log_weights.dim() - (len(plates) + 1)
    if extra > 0:
        # Only a dim shared outside the plates (IWAE's joint index) reaches a Delta in fewer
        # plates than every site on it; its weights are then the same in every plate element.
        log_weights = log_weights[(0,) * extra]
    # The source's plates are among the site's (plate dependencies are checked): broadcast.
    log_weights = log_weights.reshape((1,) * (len(plates) + 1 - log_weights.dim()) + log_weights.shape)
    return ParticleMarginal(samples, log_weights.expand(samples.shape[: len(plates) + 1]))


# -- joint draws -------------------------------------------------------------


def _condition(term: torch.Tensor, symbol: str, index: torch.Tensor) -> torch.Tensor:
    """Fix dim ``symbol`` of a packed ``term`` to the particle ``index`` (a packed tensor)."""
    if symbol not in term._pyro_dims:
        return term
    out_dims = [d for d in term._pyro_dims if d != symbol]
    out_dims += [d for d in index._pyro_dims if d not in out_dims]
    sizes = dict(zip(term._pyro_dims, term.shape))
    sizes.update(zip(index._pyro_dims, index.shape))
    source = _laid_out(term, out_dims + [symbol], sizes, expand_to=out_dims)
    picks = _laid_out(index, out_dims, sizes, expand_to=out_dims).unsqueeze(-1)
    result = source.gather(-1, picks).squeeze(-1)
    result._pyro_dims = "".join(out_dims)
    return result


def _laid_out(
    term: torch.Tensor, dims: list[str], sizes: dict[str, int], expand_to: list[str]
) -> torch.Tensor:
    """``term`` viewed over ``dims`` (:func:`~pyro_tmc.ops.shapes.packed_view`), expanded on ``expand_to``."""
    tensor = packed_view(term, dims)
    shape = [sizes[d] if d in expand_to else tensor.shape[i] for i, d in enumerate(dims)]
    return tensor.expand(shape)


def sample_posterior(draw, num_draws: int) -> dict[str, torch.Tensor]:
    """
    Exact joint draws of particle combinations from the posterior of one TMC draw.

    :param draw: a :class:`~pyro_tmc.infer.draw.TMCDraw`.

    :returns: model site name -> its values in each draw, shape ``(num_draws,) +``
        the site's plate and event shape. A Delta site's values are those at the
        drawn particles of the sites it was computed from.
    """
    model_trace, guide_trace = draw.model_trace, draw.guide_trace
    if draw.scales.markov_times:
        site = next(iter(draw.scales.markov_times.values())).sites[0]
        raise NotImplementedError(
            f"sample_posterior: site '{site}' is a vectorized_markov chain, whose joint draws are not "
            "implemented. Read its per-step marginals with compute_marginals, or write the chain with "
            "pyro.markov."
        )
    scales = dict(draw.scales.plate_scales)
    scales[DRAWS] = 1.0
    with torch.no_grad():
        factors = [f.term for f in draw.factors()]
    draws, indices = {}, {}
    for site in _in_plate_tree_order(particle_sites(model_trace, guide_trace)):
        symbol = particle_symbol(site)
        index = indices.get(symbol)  # members of a particle group share their particles' index
        if index is None:
            index = _draw_particle(factors, scales, site, symbol, num_draws)
            factors = [_condition(t, symbol, index) for t in factors]
            indices[symbol] = index
        if site["name"] in model_trace.nodes:
            draws[site["name"]] = _gather_values(site, index, model_trace.plate_to_symbol)
    for name in point_mass_sites(model_trace):
        draws[name] = _gather_point_mass(
            model_trace.nodes[name], indices, model_trace.plate_to_symbol, num_draws
        )
    return {name: draws[name] for name in model_trace.nodes if name in draws}


def _in_plate_tree_order(sites: list[dict]) -> list[dict]:
    """
    The sites in fewer plates first (stably). A plated site's particles are drawn for all its plate
    elements at once, each from its own conditional marginal, which is its joint only when the
    elements are independent given the sites already drawn: the sites outside its plates that
    couple them (its globals) must come first. The model's order does not ensure it: a guide's
    auxiliary globals (AdaptiveProposal's, an AutoGuide's) come after every model latent. Plates form
    a tree under TMC's contraction, so the sites outside a plate that touch it are in fewer plates.
    """
    return sorted(sites, key=lambda site: sum(frame.vectorized for frame in site["cond_indep_stack"]))


def _gather_point_mass(
    site, indices: dict[str, torch.Tensor], plate_to_symbol, num_draws: int
) -> torch.Tensor:
    """
    A Delta site's value at the drawn particles of every particle dim it carries:
    ``(num_draws,) + plate shape + event shape``.
    """
    value = site["value"].detach()
    event_dim = site["fn"].event_dim
    batch_ndim = value.dim() - event_dim
    plates = _plate_shape(site)
    symbols = [DRAWS] + _plate_slot_symbols(site, plate_to_symbol)
    out_shape = (num_draws,) + plates
    carried = {dim: symbol for symbol, dim in _carried_particle_dims(site, plate_to_symbol).items()}
    index = []
    for i in range(batch_ndim):
        dim, size = i - batch_ndim, value.shape[i]
        if size == 1:
            index.append(torch.zeros((), dtype=torch.long, device=value.device))
        elif dim in carried:
            index.append(packed_view(indices[carried[dim]], symbols))
        else:  # a plate dim: keep it in place
            position = len(out_shape) + dim
            index.append(torch.arange(size, device=value.device).reshape((size,) + (1,) * (-dim - 1)))
            assert out_shape[position] == size
    picked = value[tuple(index)] if index else value
    return picked.expand(out_shape + value.shape[batch_ndim:])


def _with_draws_where_needed(factors: list[torch.Tensor], num_draws: int, plates) -> list[torch.Tensor]:
    """
    Give the draws' dim (as views) to every factor that shares a sum dim, directly
    or through others, with a factor already conditioned on drawn particles: those
    sums differ between draws. The rest is the same for every draw and stays small,
    so memory grows with num_draws only where the draws have made things differ.
    """
    carrying = {i for i, t in enumerate(factors) if DRAWS in t._pyro_dims}
    dims = (
        set().union(*(set(factors[i]._pyro_dims) for i in carrying)) - set(plates) - {DRAWS}
        if carrying
        else set()
    )
    grown = True
    while grown:
        grown = False
        for i, term in enumerate(factors):
            if i not in carrying and dims & set(term._pyro_dims):
                carrying.add(i)
                dims |= set(term._pyro_dims) - set(plates)
                grown = True
    result = []
    for i, term in enumerate(factors):
        if i in carrying and DRAWS not in term._pyro_dims:
            expanded = term.expand((num_draws,) + term.shape)
            expanded._pyro_dims = DRAWS + term._pyro_dims
            term = expanded
        result.append(term)
    return result


def _draw_particle(factors, scales, site, symbol: str, num_draws: int) -> torch.Tensor:
    """One particle of ``site`` per draw and plate element, from its conditional marginal."""
    factors = _with_draws_where_needed(list(factors), num_draws, scales)
    sizes = {}
    for term in factors:
        sizes.update(zip(term._pyro_dims, term.shape))
    plates = [d for d in site["infer"]["_dim_to_symbol"].values() if d in scales and d in sizes]
    device = factors[0].device
    if symbol not in sizes:  # a single particle: nothing to choose
        index = torch.zeros([num_draws] + [sizes[d] for d in plates], dtype=torch.long, device=device)
        index._pyro_dims = DRAWS + "".join(plates)
        return index
    per_draw = any(symbol in t._pyro_dims and DRAWS in t._pyro_dims for t in factors)
    dims = ([DRAWS] if per_draw else []) + [symbol] + plates
    source = torch.zeros([sizes[d] for d in dims], requires_grad=True, device=device)
    source._pyro_dims = "".join(dims)
    with torch.enable_grad():
        log_p = contract_log_factors(list(factors) + [source], scales)
        grads = torch.autograd.grad(log_p, [source])
    # What scales the source from outside: the plates it sits in (the factors keep no tempering).
    plate_scale = math.prod(scales[d] for d in plates)
    (marginal,) = source_weights({symbol: source}, grads, lambda _: plate_scale).values()
    probs = marginal.clamp(min=0).movedim(dims.index(symbol), -1)  # ([draws,] plates..., K)
    index = Categorical(probs=probs).sample(() if per_draw else (num_draws,))
    index._pyro_dims = DRAWS + "".join(plates)
    return index


def _gather_values(site, index: torch.Tensor, plate_to_symbol: dict[str, str]) -> torch.Tensor:
    """The site's values at the drawn particles: (num_draws,) + plate shape + event shape."""
    event_dim = site["fn"].event_dim
    values = _particles_last(site, site["value"].detach(), event_dim)  # plates + (K,) + event
    plates = _plate_shape(site)
    symbols = _plate_slot_symbols(site, plate_to_symbol)
    # An unplated slot's symbol is "" (a dim of size 1 under an outer plate): packed_view leaves it 1.
    index = packed_view(index, [DRAWS] + symbols)
    index = index.expand(index.shape[:1] + plates)
    values = values.expand(index.shape[:1] + values.shape)
    picks = index.reshape(index.shape + (1,) * (event_dim + 1))
    picks = picks.expand(index.shape + (1,) + values.shape[values.dim() - event_dim :])
    return values.gather(1 + len(plates), picks).squeeze(1 + len(plates))
