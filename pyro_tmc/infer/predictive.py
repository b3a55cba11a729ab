"""Held-out predictive log-likelihood from posterior draws, with its standard error.

The posterior predictive density of test data is

    p(y_test | y_train) = E_{theta ~ p(theta | y_train)} [ p(y_test | theta) ],

estimated here by ``log sum_s a_s p_hat(y_test | theta_s)`` over weighted posterior
draws ``theta_s``: the joint draws of several independent TMC draws
(:meth:`~pyro_tmc.infer.tmc_elbo.TMC_ELBO.sample_posterior`), each set weighted by its
TMC draw's estimate ``P_TMC`` of ``p(y_train)`` (:func:`posterior_draws`). That weighting
pools the TMC draws into one importance sampler over all their particle combinations,
consistent as TMC draws are added for any K; one TMC draw alone, or equal weights, keep
the O(1/K) bias of self-normalised weights, and one draw's standard error cannot see it.

The model is called with the test data, so its plates take the test rows' sizes.
Latents shared by training and test rows (the global ones, and those of groups such
as counties) are fixed to each draw's values. Latents local to the test rows are new:
they are marginalised under the prior, by one TMC draw per posterior draw with the
model's own conditionals as proposals (``num_samples`` particles per local site),
so that ``p_hat(y_test | theta_s)`` is an unbiased estimate of ``p(y_test | theta_s)``
computed row by row, and exact for local sites summed by enumeration. All draws run in
one vectorised pass: they are a plate, left of the model's plates, that the contraction
keeps instead of multiplying out. This is what the alan library computes by extending
its plates to the test rows and drawing their latents from the prior [1], with an
importance average over the new latents instead of one prior draw.

References

[1] `Massively Parallel Reweighted Wake-Sleep`, Heap, Hayes and Aitchison (UAI 2023);
    its code, alan's ``predictive_ll``.
"""

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Callable, NamedTuple, Optional, Union

import torch

import pyro
from pyro.ops.contract import contract_to_tensor
from pyro.ops.rings import LogRing
from pyro.poutine import Trace
from pyro.poutine.messenger import Messenger

from pyro_tmc.infer.tmc_elbo import TMC_ELBO
from pyro_tmc.poutine.sites import is_latent, plate_frames, plate_nesting, structure_trace

#: the plate that holds the posterior draws in the test run
DRAWS_PLATE = "_predictive_draws"


class PosteriorDraws(NamedTuple):
    """
    Posterior draws pooled from independent TMC draws (:func:`posterior_draws`).

    :ivar list samples: one dict per TMC draw, site name -> draws (leading dim: the draws).
    :ivar torch.Tensor log_evidences: each TMC draw's ``log P_TMC`` of the training data.
    """

    samples: list[dict[str, torch.Tensor]]
    log_evidences: torch.Tensor


class PredictiveLogLikelihood(NamedTuple):
    """
    The result of :func:`predictive_log_likelihood`.

    :ivar torch.Tensor log_likelihood: ``log sum_s a_s p_hat(y_test | theta_s)``, a scalar, with
        ``a_s`` the draws' weights (``1/S`` for one set of draws).
    :ivar torch.Tensor standard_error: its Monte Carlo standard error, by the delta method: over the
        draws for one set of draws, ``sd_s(w_s) / (sqrt(S) mean_s(w_s))`` with ``w_s = p_hat(y_test |
        theta_s)``; over the pools (each TMC draw's mean of ``w_s``) for several, which also covers the
        error of each TMC draw's particles; NaN when fewer than 2 sets carry the weight.
    :ivar torch.Tensor log_likelihoods: ``log p_hat(y_test | theta_s)`` for each draw, shape ``(S,)``.
    :ivar torch.Tensor log_weights: ``log a_s`` for each draw, shape ``(S,)``.
    """

    log_likelihood: torch.Tensor
    standard_error: torch.Tensor
    log_likelihoods: torch.Tensor
    log_weights: torch.Tensor

    @property
    def effective_sample_size(self) -> float:
        """``(sum a w)^2 / sum (a w)^2``: how many draws carry the estimate (a few: unreliable)."""
        log_w = self.log_likelihoods + self.log_weights
        return float(torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)))


def posterior_draws(
    elbo: TMC_ELBO,
    model: Callable,
    guide: Callable,
    *args,
    num_tmc_draws: int = 10,
    num_draws: int = 100,
    **kwargs,
) -> PosteriorDraws:
    """
    ``num_draws`` joint posterior draws from each of ``num_tmc_draws`` independent TMC
    draws (:meth:`~pyro_tmc.TMC_ELBO.sample_posterior`), with each TMC draw's
    ``log P_TMC``: :func:`predictive_log_likelihood` weights each set by it, which makes
    the pooled estimate consistent as TMC draws are added, for any K.

    :rtype: PosteriorDraws
    """
    samples, log_evidences = [], []
    for _ in range(num_tmc_draws):
        with torch.no_grad():
            draw = elbo.draw(model, guide, *args, **kwargs)
            log_evidences.append(draw.log_estimate().reshape(()))
            samples.append(draw.sample(num_draws))
    return PosteriorDraws(samples, torch.stack(log_evidences))


def predictive_log_likelihood(
    model: Callable,
    posterior_samples: Union[dict[str, torch.Tensor], Sequence[dict[str, torch.Tensor]], PosteriorDraws],
    *args,
    num_samples: int = 16,
    local_plates: Optional[Iterable[str]] = None,
    max_plate_nesting: Optional[int] = None,
    **kwargs,
) -> PredictiveLogLikelihood:
    """
    The held-out predictive log-likelihood ``log p(y_test | y_train)`` of test data,
    from posterior draws given the training data.

    Example::

        elbo = TMC_ELBO(num_samples=16, max_plate_nesting=1)
        # ... train with SVI(model, guide, optim, elbo) on x_train, y_train ...
        draws = posterior_draws(elbo, model, guide, x_train, y_train, num_tmc_draws=10, num_draws=100)
        result = predictive_log_likelihood(model, draws, x_test, y_test)
        result.log_likelihood, result.standard_error

    As in :class:`pyro.infer.Predictive`, ``model`` is called with ``*args, **kwargs``
    (here the test data, observed), and the sites in ``posterior_samples`` are fixed to
    their drawn values, one posterior draw per element of the leading dim.
    Sites inside ``local_plates`` are not fixed: they belong to the test rows, and are
    marginalised under the prior, ``num_samples`` particles each (see the module's notes).
    Model latents absent from ``posterior_samples`` are marginalised the same way.

    :param callable model: the Pyro model, whose observed sites hold the test data.
    :param posterior_samples: site name -> draws, leading dim the draws (``(S,) +`` the site's
        plate and event shape, as ``sample_posterior`` returns them); or a list of such dicts, one
        per independent TMC draw (weighted equally; the standard error is then taken over them);
        or a :class:`PosteriorDraws` (:func:`posterior_draws`), whose sets are weighted by their
        TMC draw's ``P_TMC``: consistent for any K as TMC draws are added (recommended).
    :param int num_samples: particles per local latent in the inner TMC average.
    :param local_plates: names of the plates that index the test rows: latents inside them are
        the test rows' own. ``None``: the plates whose size differs between the drawn latents and
        the test run; if every plate that holds a drawn latent keeps its size (test rows as many
        as training rows, or new rows of shared groups), a ``ValueError`` asks for the names.
    :param int max_plate_nesting: the model's plate nesting; read from a trial run if omitted.
    :returns: the estimate, its standard error and the per-draw terms.
    :rtype: PredictiveLogLikelihood
    :raises ValueError: for draws of different counts, or a site whose draws do not fit it.
    """
    pools, pool_log_weights = _pools(posterior_samples)
    posterior_samples = {name: torch.cat([pool[name] for pool in pools]) for name in pools[0]}
    num_draws = _count_draws(posterior_samples)
    with torch.no_grad():
        trial = structure_trace(model, args, kwargs)
    nesting = plate_nesting(trial) if max_plate_nesting is None else max_plate_nesting
    local = _local_plates(trial, posterior_samples, local_plates)
    fixed = {
        name: batched_over_draws(posterior_samples[name], site, nesting)
        for name, site in trial.nodes.items()
        if is_latent(site) and name in posterior_samples and not (_plate_names(site) & local)
    }

    def conditioned_model(*model_args, **model_kwargs):
        with pyro.plate(DRAWS_PLATE, num_draws, dim=-nesting - 1), FixedSites(fixed):
            return model(*model_args, **model_kwargs)

    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=nesting + 1, max_factor_bytes=None)
    with torch.no_grad():
        draw = elbo.draw(conditioned_model, _no_guide, *args, **kwargs)
        log_likelihoods = _log_estimate_per_draw(draw, num_draws)
    pool_sizes = [_count_draws(pool) for pool in pools]
    return summarise(log_likelihoods, pool_sizes, pool_log_weights)


def summarise(
    log_likelihoods: torch.Tensor, pool_sizes: Optional[list[int]] = None, pool_log_weights=None
) -> PredictiveLogLikelihood:
    """
    ``log sum_p a_p mean_{s in p} w_s`` of per-draw log-likelihoods ``log w_s`` in pools of
    draws (one pool: all draws) with pool weights ``a_p`` (softmax of ``pool_log_weights``,
    else equal), and the delta-method standard error: over the draws for one pool, over
    the pools for several (the ratio estimator's).
    """
    num_draws = log_likelihoods.shape[0]
    pool_sizes = [num_draws] if pool_sizes is None else list(pool_sizes)
    if pool_log_weights is None:
        pool_log_weights = log_likelihoods.new_zeros(len(pool_sizes))
    pool_weights = torch.softmax(torch.as_tensor(pool_log_weights, dtype=log_likelihoods.dtype), 0)
    sizes = torch.tensor(pool_sizes, dtype=log_likelihoods.dtype)
    log_weights = torch.repeat_interleave((pool_weights / sizes).log(), torch.tensor(pool_sizes))
    log_estimate = torch.logsumexp(log_likelihoods + log_weights, 0)
    relative = torch.exp(log_likelihoods - log_estimate)  # w_s / estimate
    if len(pool_sizes) > 1:
        pool_means = torch.stack([part.mean() for part in relative.split(pool_sizes)])
        standard_error = (pool_weights.square() * (pool_means - 1).square()).sum().sqrt()
        if 1 / pool_weights.square().sum() < 2:  # one set carries it all: its spread is unknown
            standard_error = standard_error * math.nan
    elif num_draws > 1:
        standard_error = relative.std(unbiased=True) / math.sqrt(num_draws)
    else:
        standard_error = log_estimate * math.nan
    return PredictiveLogLikelihood(log_estimate, standard_error, log_likelihoods, log_weights)


def _pools(posterior_samples) -> tuple[list[dict[str, torch.Tensor]], Optional[torch.Tensor]]:
    """The sets of draws, and their log weights (``None``: equal)."""
    if isinstance(posterior_samples, PosteriorDraws):
        return list(posterior_samples.samples), posterior_samples.log_evidences
    if isinstance(posterior_samples, dict):
        return [posterior_samples], None
    pools = list(posterior_samples)
    if not pools or any(set(pool) != set(pools[0]) for pool in pools):
        raise ValueError(
            "predictive_log_likelihood: a list of posterior_samples needs the same sites in each."
        )
    return pools, None


class FixedSites(Messenger):
    """
    Fix the named latent sites to given values, and leave their own density out:
    ``p(y_test | theta)`` is wanted, not ``p(y_test, theta)``. (``poutine.condition``
    would count ``log p(theta)``.)

    :param dict values: site name -> value.
    """

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.values = values

    def _pyro_sample(self, msg: dict) -> None:
        if msg["name"] in self.values:
            msg["value"] = self.values[msg["name"]]
            msg["is_observed"] = True
            msg["mask"] = False


def _no_guide(*args, **kwargs) -> None:
    """No guide: every latent left free is drawn from the model's conditional."""


def _plate_names(site: dict) -> frozenset[str]:
    return frozenset(frame.name for frame in plate_frames(site))


def _count_draws(posterior_samples: dict[str, torch.Tensor]) -> int:
    counts = {name: value.shape[0] for name, value in posterior_samples.items() if value.dim() > 0}
    if not counts or len(set(counts.values())) != 1:
        raise ValueError(
            "posterior_samples needs the same number of draws (leading dim) at every site; got "
            f"{counts}. Pass the dict that sample_posterior(..., num_draws=S) returns."
        )
    return next(iter(counts.values()))


def _drawn_size(value: torch.Tensor, site: dict, dim: int) -> int:
    """The size of one draw of ``value`` (its leading dim removed) at batch dim ``dim``, 1 if it has none."""
    batch = value.shape[1 : value.dim() - site["fn"].event_dim]
    return batch[dim] if -dim <= len(batch) else 1


def _local_plates(trial: Trace, posterior_samples, local_plates) -> frozenset[str]:
    """The plates of the test rows: named, or those whose drawn size is not the test run's."""
    if local_plates is not None:
        return frozenset([local_plates] if isinstance(local_plates, str) else local_plates)
    changed, shared = set(), set()
    for name, site in trial.nodes.items():
        if not is_latent(site) or name not in posterior_samples:
            continue
        for frame in plate_frames(site):
            same = _drawn_size(posterior_samples[name], site, frame.dim) == frame.size
            (shared if same else changed).add(frame.name)
    if shared and not changed:
        raise ValueError(
            f"predictive_log_likelihood: the drawn latents' plates {sorted(shared)} have the same sizes in "
            "the test run as in the draws, so the test rows cannot be told apart from the training rows. "
            "Name the plates that index the test rows with local_plates=(...) (e.g. local_plates=('rows',) "
            "for new rows of groups that the training rows share)."
        )
    return frozenset(changed)


def batched_over_draws(value: torch.Tensor, site: dict, nesting: int) -> torch.Tensor:
    """A site's draws, ``(S,) + plate shape + event``, shaped for the draws' plate (dim ``-nesting - 1``)."""
    event_dim = site["fn"].event_dim
    plate_ndim = value.dim() - 1 - event_dim
    expected = site["fn"].batch_shape
    drawn = value.shape[1 : 1 + plate_ndim]
    try:
        torch.broadcast_shapes(drawn, expected)
    except RuntimeError:
        raise ValueError(
            f"predictive_log_likelihood: site '{site['name']}' has draws of shape {tuple(drawn)} per draw "
            f"but batch shape {tuple(expected)} in the test run. If it belongs to the test rows, name its "
            "plate in local_plates=(...); otherwise call the model with the plate sizes it was trained with."
        ) from None
    if plate_ndim > nesting:
        raise ValueError(
            f"predictive_log_likelihood: site '{site['name']}' has {plate_ndim} batch dims per draw, more "
            f"than max_plate_nesting={nesting}."
        )
    return value.reshape(value.shape[:1] + (1,) * (nesting - plate_ndim) + value.shape[1:])


def _log_estimate_per_draw(draw, num_draws: int) -> torch.Tensor:
    """
    ``log P_TMC`` of each draw: the contraction of the TMC factors, with every
    particle dim summed and every plate multiplied out except the draws' plate.
    """
    model_trace = draw.model_trace
    scales = draw.scales.plate_scales
    if draw.scales.markov_times:  # its time dim is a chain, which this contraction would multiply out
        site = next(iter(draw.scales.markov_times.values())).sites[0]
        raise NotImplementedError(
            f"predictive_log_likelihood: site '{site}' is a vectorized_markov chain, which is not "
            "implemented here. Write the chain with pyro.markov."
        )
    if any(scale != 1.0 for scale in scales.values()) or draw.scales.root != 1.0:
        raise NotImplementedError(
            "predictive_log_likelihood: the test run has a subsampled plate or poutine.scale; "
            "call the model on the whole test set, unscaled."
        )
    draws_symbol = model_trace.plate_to_symbol[DRAWS_PLATE]
    factors = [factor.term for factor in draw.factors()]
    plates = frozenset(scales) | {draws_symbol}
    tree: OrderedDict[frozenset[str], list] = OrderedDict()
    sizes: dict[str, int] = {draws_symbol: num_draws}  # a single draw's plate has no dim in the factors
    for term in factors:
        sizes.update(zip(term._pyro_dims, term.shape))
        tree.setdefault(plates.intersection(term._pyro_dims), []).append(term)
    if not factors:
        return torch.zeros(num_draws)
    sum_dims = set("".join(term._pyro_dims for term in factors)) - plates
    ring = LogRing(dim_to_size=sizes)
    result = contract_to_tensor(tree, sum_dims, target_ordinal=frozenset([draws_symbol]), ring=ring)
    if draws_symbol not in result._pyro_dims:  # nothing varies with the draws
        return result.reshape(()).expand(num_draws)
    return result.reshape(num_draws)
