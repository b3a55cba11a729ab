"""Element-wise conditional moments for QEM's vector sites: a Rao-Blackwellised update.

TMC proposes a vector site (an event of D elements, e.g. ``Normal(0, 1).expand([59]).to_event(1)``)
as K whole vectors in one particle dim. Its K weights then judge all D elements at once, and in
many dims one particle takes nearly all the weight (an effective sample size near 1): QEM's moments
of the site are one guide draw, and a moving-average step larger than about 0.1 collapses the guide.

This module reads each element's moments from its own conditional instead. Given one joint draw
``z*`` of every latent from the TMC posterior, element ``j`` of the site gets K candidates
``u_1..u_K ~ q_j`` (the guide's marginal of that element) besides its drawn value ``z*_j``, and the
self-normalised importance weights

    w_k ∝ p(x, z* with element j set to u_k) / q_j(u_k)

give ``E[T(z_j) | z*_{-j}, x]``, the element's sufficient statistics under its full conditional.
Their average over draws of ``z*`` is the marginal expectation ``E[T(z_j) | x]`` (the tower rule,
as in a Rao-Blackwellised Gibbs sampler), which is QEM's target. Each element's weights compare
one-dimensional candidates, so their effective sample size does not fall with D.

Including the drawn value among the candidates is the conditional importance sampling kernel of
Markovian score climbing [1]: where ``z*`` is a posterior draw it keeps the estimate anchored even
when ``q_j`` is still far from the conditional.

The tower rule needs ``z*`` to be a posterior draw; here it is a draw from the TMC posterior of
one step's particles, whose self-normalised weights bias it towards the guide where they are
uneven. The bias falls with K and as the guide nears the posterior (the tests measure the fixed
point against exact Gaussian marginals); averaging over R reference draws a step (``QEM``'s
``num_references``) lowers the noise, which the moving average otherwise feeds back into the guide.

Every candidate of every element is one batch entry of vectorised runs of the model (64 at a time),
conditioned on ``z*`` (discrete latents too, at their drawn values): the batch dims sit left of the
model's plates (``max_plate_nesting``), as TMC's particle dims do, so any model TMC runs broadcasts
them. The cost is ``R x (D K + 1)`` model evaluations at one value of every other latent, against
TMC's K-fold sums over every factor; on the bus data (D = 59, K = 10, R = 4) ten times a TMC step.

``QEM(elementwise="auto")`` takes the sites in no plate; a site in plates, named, gets each plate
element's conditionals at once, each from the factors in the site's plates (TMC lets no factor
outside a plate depend on a site in it). Every site needs an element-wise family (Normal,
LogNormal, Gamma, or an unconstrained Normal whose bijection is element-wise).

References

[1] `Markovian Score Climbing: Variational Inference with KL(p||q)`,
    Christian A. Naesseth, Fredrik Lindsten and David Blei (NeurIPS 2020)
"""

from typing import Callable, Optional

import torch

from pyro import poutine
from pyro.poutine.util import prune_subsample_sites

#: the largest event ``QEM(elementwise="auto")`` takes: each of D elements gets K candidate vectors
#: of D elements, so one step's candidates hold D^2 K values per reference draw
MAX_AUTO_ELEMENTS = 256
#: candidates per run of the model: the runs' tensors grow with them, and a few runs of smaller
#: tensors are faster than one large one (measured on the bus data's 591: 64 at a time, 1.7x)
CANDIDATES_PER_RUN = 64


def is_elementwise_site(
    guide, name: str, max_elements: float = float("inf"), allow_plates: bool = False
) -> bool:
    """
    Whether guide site ``name`` can take element-wise moments: an event of more than one element
    (and at most ``max_elements``), a family whose distribution factorises over the elements, and no
    plates unless ``allow_plates``.

    :param guide: a set-up :class:`~pyro_tmc.infer.qem.QEMGuide`.
    :param str name: the site.
    :param max_elements: the largest event taken (the cost grows as its square).
    :param bool allow_plates: whether a site in plates qualifies (each plate element then has
        its own conditionals, read from the factors in its plates).
    """
    site = guide.sites[name]
    if site.event_dim == 0 or (site.frames and not allow_plates):
        return False
    plate_dims = {frame.dim for frame in site.frames}
    batch_ndim = len(site.batch_shape)
    if any(size > 1 and dim - batch_ndim not in plate_dims for dim, size in enumerate(site.batch_shape)):
        return False  # a batch dim that is no plate: its elements share their factors
    first, second = guide.statistics(name)
    if not 2 <= first[(0,) * len(site.batch_shape)].numel() <= max_elements:
        return False
    return site.family.distribution(first, second).event_dim == 0


def elementwise_statistics(
    model: Callable,
    guide,
    name: str,
    reference: dict[str, torch.Tensor],
    event_dims: dict[str, int],
    args: tuple,
    kwargs: dict,
    num_candidates: int,
    max_plate_nesting: int,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """
    The site's two sufficient statistics under each element's full conditional, averaged over the
    reference draws (see the module's docstring). In plates, every plate element's conditionals at once.

    :param callable model: the Pyro model.
    :param guide: the :class:`~pyro_tmc.infer.qem.QEMGuide` (its current marginals propose).
    :param str name: a site for which :func:`is_elementwise_site` holds.
    :param dict reference: site name -> ``(R,) + plate shape + event shape`` values of R joint draws
        (:func:`~pyro_tmc.infer.posterior.sample_posterior`).
    :param dict event_dims: site name -> its event dims, for every site in ``reference``.
    :param tuple args: the model's arguments.
    :param dict kwargs: the model's keyword arguments.
    :param int num_candidates: the K candidates per element, besides the drawn value.
    :param int max_plate_nesting: the model's plate dims (the batch dims go left of them).
    :returns: the pair ``(E[T_1], E[T_2])``, each of the guide site's batch and event shape; ``None``
        if the draws do not hold every latent of the model.
    """
    site = guide.sites[name]
    marginal = site.family.distribution(*guide.statistics(name))
    batch_shape = site.batch_shape
    event_shape = marginal.batch_shape[len(batch_shape) :]
    num_draws = reference[name].shape[0]
    drawn = reference[name].reshape((num_draws,) + batch_shape + (-1,))  # (R,) + batch + (D,)
    num_elements = drawn.shape[-1]
    with torch.no_grad():
        proposed = marginal.sample((num_draws, num_candidates)).reshape(
            (num_draws, num_candidates) + drawn.shape[1:]
        )
        candidates = _candidates(drawn, proposed)  # (R, 1 + D K) + batch + (D,)
        candidates = candidates.reshape(candidates.shape[:-1] + event_shape)
        chunks = []
        for chunk in candidates.split(max(1, CANDIDATES_PER_RUN // num_draws), 1):
            log_joint = _log_joint(
                model, name, chunk, site, reference, event_dims, args, kwargs, max_plate_nesting
            )
            if log_joint is None:
                return None
            chunks.append(log_joint)
        log_joint = torch.cat(chunks, 1)  # (R, 1 + D K) + batch
        values = torch.cat([drawn.unsqueeze(1), proposed], 1)  # (R, 1 + K) + batch + (D,): each element's
        log_proposal = marginal.log_prob(values.reshape(values.shape[:-1] + event_shape)).reshape(
            values.shape
        )
        # element j's candidate k > 0 is batch entry 1 + j K + (k - 1); the drawn value is entry 0
        per_element = log_joint[:, 1:].reshape((num_draws, num_elements, num_candidates) + batch_shape)
        per_element = per_element.movedim(1, -1)  # (R, K) + batch + (D,)
        drawn_target = log_joint[:, :1].unsqueeze(-1).expand((num_draws, 1) + batch_shape + (num_elements,))
        weights = (torch.cat([drawn_target, per_element], 1) - log_proposal).softmax(1)
        first, second = site.family.statistics(values.reshape(values.shape[:-1] + event_shape))
        first = (weights * first.reshape(values.shape)).sum(1).mean(0)
        second = (weights * second.reshape(values.shape)).sum(1).mean(0)
    return first.reshape(batch_shape + event_shape), second.reshape(batch_shape + event_shape)


def _candidates(drawn: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """
    The drawn vectors (``(R,) + batch + (D,)``), then each with one element replaced by each of its
    proposals (``(R, K) + batch + (D,)``): ``(R, 1 + D K) + batch + (D,)``, element j's K candidates at
    entries ``1 + j K .. (j + 1) K`` (in every batch element at once).
    """
    num_draws, num_candidates = proposed.shape[:2]
    batch_shape, num_elements = drawn.shape[1:-1], drawn.shape[-1]
    replaced = torch.eye(num_elements, dtype=torch.bool, device=drawn.device)
    replaced = replaced.reshape((1, num_elements, 1) + (1,) * len(batch_shape) + (num_elements,))
    swapped = torch.where(replaced, proposed.unsqueeze(1), drawn.unsqueeze(1).unsqueeze(1))
    swapped = swapped.reshape((num_draws, num_elements * num_candidates) + drawn.shape[1:])
    return torch.cat([drawn.unsqueeze(1), swapped], 1)


def _log_joint(
    model: Callable,
    name: str,
    candidates: torch.Tensor,
    site,
    reference: dict[str, torch.Tensor],
    event_dims: dict[str, int],
    args: tuple,
    kwargs: dict,
    max_plate_nesting: int,
) -> Optional[torch.Tensor]:
    """
    ``log p(x, z)`` at every candidate of site ``name`` (``(R, C) + batch + event``), every other
    latent at its reference draw: ``(R, C) + batch``, each plate element of the site with the factors
    in its plates (TMC's plates let no factor outside them depend on it; the rest are left out).
    ``None`` if the model has a latent the reference lacks.
    """
    num_draws, num_batch = candidates.shape[:2]
    batch_shape = site.batch_shape
    values = {}
    for other, value in reference.items():
        if other != name:
            plate_ndim = value.dim() - 1 - event_dims[other]
            values[other] = value.reshape(
                (num_draws, 1) + (1,) * (max_plate_nesting - plate_ndim) + value.shape[1:]
            )
    padding = (1,) * (max_plate_nesting - len(batch_shape))
    values[name] = candidates.reshape((num_draws, num_batch) + padding + candidates.shape[2:])
    trace = prune_subsample_sites(
        poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    )
    own_plates = {frame.name for frame in site.frames}
    own_dims = {frame.dim for frame in site.frames}
    summed = tuple(dim for dim in range(-max_plate_nesting, 0) if dim not in own_dims)
    total = candidates.new_zeros((num_draws, num_batch) + padding + batch_shape)
    for node in trace.nodes.values():
        if node["type"] != "sample":
            continue
        if not node["is_observed"]:
            return None  # a latent the reference does not fix
        if not own_plates <= {frame.name for frame in node["cond_indep_stack"]}:
            continue  # outside the site's plates: independent of its values
        log_prob = _scaled(node["fn"].log_prob(node["value"]), node)
        log_prob = log_prob.reshape((1,) * (max_plate_nesting + 2 - log_prob.dim()) + log_prob.shape)
        total = total + (log_prob.sum(summed, keepdim=True) if summed else log_prob)
    if total.shape != (num_draws, num_batch) + padding + batch_shape:
        raise ValueError(
            f"QEM(elementwise=...): the model's log-densities at site '{name}'s candidates have batch shape "
            f"{tuple(total.shape)}, not {(num_draws, num_batch) + padding + batch_shape}: the model must "
            f"broadcast batch dims left of its {max_plate_nesting} plate dims, as TMC's particle dims."
        )
    return total.reshape((num_draws, num_batch) + batch_shape)


def _scaled(log_prob: torch.Tensor, node: dict) -> torch.Tensor:
    """A site's log-density with its ``poutine.scale`` and ``poutine.mask`` applied."""
    if node["mask"] is not None:
        log_prob = torch.where(node["mask"], log_prob, log_prob.new_zeros(()))
    return log_prob * node["scale"]
