"""Checks of a draw and of its factors, each raising an error that names the site and the fix.

- :func:`check_site_shapes`: Pyro's plate-shape checks, as ``TraceEnum_ELBO`` runs them;
- :func:`check_plate_dependencies`: no site depends on a latent inside a plate it is not in;
- :func:`check_finite`: where the estimate is not finite, the site responsible;
- :func:`validate_samples`: each value in its distribution's support, eagerly (for ``compile=``);
- :func:`log_prob_error`, :func:`packing_error`: a value or a log density that does not fit, naming the site.
"""

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Optional

import torch

from pyro.poutine import Trace
from pyro.util import check_site_shape

from pyro_tmc.ops.capture import is_tracing
from pyro_tmc.ops.shapes import log_prob_shape
from pyro_tmc.poutine.sites import has_particle_dim, is_sample, particle_draw, particle_symbol, plate_symbols


def log_prob_error(site, error: ValueError) -> ValueError:
    """A distribution's complaint about a value, naming the site it came from."""
    return ValueError(f"Error while computing log_prob at site '{site['name']}': {error}")


def observed_nan_error(site: str) -> ValueError:
    """An observed value with missing entries, and how to keep them out."""
    return ValueError(
        f"The observed value of site '{site}' contains NaN. Remove the missing entries, or "
        "mask them out with poutine.mask (or obs_mask) and give them any finite placeholder."
    )


def packing_error(site, tensor: torch.Tensor, dim_to_symbol) -> ValueError:
    """A site's log factor whose shape fits neither its plates nor its particle dims."""
    return ValueError(
        f"The log density of site '{site['name']}' has shape {tuple(tensor.shape)}, which does not fit "
        f"its plates and particle dims (dims {sorted(dim_to_symbol)}): a value was probably "
        "broadcast so that particles landed on a plate dim or the reverse. See 'Writing models "
        "for TMC: broadcasting and Vindex' in the README."
    )


def validate_samples(model_trace: Trace, guide_trace: Trace) -> None:
    """
    The checks that ``log_prob`` makes under validation (each value in its
    distribution's support and of a fitting shape), run eagerly: a graph of the
    estimate (:mod:`pyro_tmc.compile.compiled`) cannot branch on values, so its
    distributions skip them.
    """
    for trace in (model_trace, guide_trace):
        for site in trace.nodes.values():
            fn = site.get("fn")
            if site["type"] == "sample" and getattr(fn, "_validate_args", False):
                try:
                    fn._validate_sample(site["value"])
                except ValueError as error:
                    if site["is_observed"] and torch.isnan(site["value"]).any():
                        raise observed_nan_error(site["name"]) from error
                    raise log_prob_error(site, error) from error


def check_site_shapes(model_trace: Trace, guide_trace: Trace, max_plate_nesting) -> None:
    """
    Pyro's plate-shape and enumeration-dim checks (:func:`pyro.util.check_site_shape`)
    on every sample site, as ``TraceEnum_ELBO`` runs them under validation.
    """
    for trace in (model_trace, guide_trace):
        for site in trace.nodes.values():
            if not is_sample(site):
                continue
            log_prob = SimpleNamespace(shape=log_prob_shape(site))  # all the check reads of it
            infer = site["infer"]
            draw = particle_draw(site)
            if draw is not None and (draw.joint or draw.group is not None):  # shares a dim by design
                infer = {k: v for k, v in infer.items() if k != "_enumerate_dim"}
            check_site_shape({**site, "infer": infer, "log_prob": log_prob}, max_plate_nesting)


def check_plate_dependencies(model_trace: Trace, guide_trace: Trace) -> None:
    """
    :raises ValueError: naming both sites, where a site depends on the
        particles of a latent inside a plate that the site is not in. Its factor
        would couple particle k of every plate element, which the contraction
        (sums inside plates, products across them) cannot express; as in
        ``TraceEnum_ELBO``, a variable outside a plate must never depend on one inside it.
    """
    traces = (guide_trace, model_trace)
    owners = _plated_particle_owners(traces)
    if not owners:
        return
    for trace in traces:
        for name, site in trace.nodes.items():
            if is_sample(site):
                _check_site_plates(name, site, trace, owners)


def _plated_particle_owners(traces: Sequence[Trace]) -> dict[str, tuple[str, frozenset]]:
    """Particle symbol -> (the latent it belongs to, that latent's plate symbols), for plated latents."""
    owners = {}
    for trace in traces:
        for name, site in trace.nodes.items():
            if not is_sample(site) or not has_particle_dim(site):
                continue
            draw = particle_draw(site)
            if draw is not None and draw.joint:
                continue  # the shared dim of joint samples is summed outside every plate
            plates = plate_symbols(site, trace)
            if plates:  # a latent outside every plate can be depended on by anything
                owners[particle_symbol(site)] = (name, plates)
    return owners


def _check_site_plates(name: str, site, trace: Trace, owners: dict[str, tuple[str, frozenset]]) -> None:
    """Raise where ``site`` varies along the particles of a latent in a plate the site is not in."""
    plates = batch = None
    for dim, symbol in site["infer"].get("_dim_to_symbol", {}).items():
        owner = owners.get(symbol)
        if owner is None:
            continue
        if batch is None:
            plates, batch = plate_symbols(site, trace), log_prob_shape(site)
        if -dim > len(batch) or batch[dim] == 1:
            continue  # visible to the site, but its factor does not vary along it
        if not owner[1] <= plates:
            raise ValueError(
                f"Site '{name}' depends on latent '{owner[0]}', which is inside a plate that "
                f"'{name}' is not in. A variable outside a plate must never depend on one "
                "inside it (as in TraceEnum_ELBO): move the site into the plate, or the latent "
                "out of it (e.g. sample a plate of globals as one vector with .to_event(1))."
            )


def _non_finite(term) -> tuple:
    """
    Whether a factor holds a NaN, holds +inf, and is -inf everywhere; a chunked
    factor (:class:`~pyro_tmc.ops.chunked.ChunkedFactor`) is read slice by slice
    (whole, it may not fit in memory).
    """
    pieces = [term] if isinstance(term, torch.Tensor) else (term.compute(a, b) for a, b in term.ranges())
    has_nan = has_posinf = False
    all_neginf, numel = True, 0
    with torch.no_grad():
        for piece in pieces:
            has_nan = has_nan or bool(torch.isnan(piece).any())
            has_posinf = has_posinf or bool(torch.isposinf(piece).any())
            all_neginf = all_neginf and bool((piece == -math.inf).all())
            numel += piece.numel()
    return has_nan, has_posinf, all_neginf and numel > 0


def check_finite(
    factors: Sequence[tuple], estimate: torch.Tensor, model_trace: Optional[Trace] = None
) -> None:
    """
    If the estimate is not finite, find the site responsible.

    :param factors: the draw's :class:`~pyro_tmc.estimate.factors.LogFactor` s.
    :raises ValueError: naming the first site whose factor holds a NaN or
        +inf, or is -inf everywhere.
    """
    if is_tracing() or torch.isfinite(estimate).all():
        return  # a graph being traced: its caller recomputes a non-finite estimate eagerly
    for factor in factors:
        site = factor.site
        has_nan, has_posinf, all_neginf = _non_finite(factor.term)
        if has_nan:
            node = model_trace.nodes.get(site) if model_trace is not None else None
            if node is not None and node["is_observed"] and torch.isnan(node["value"]).any():
                raise observed_nan_error(site)
            raise ValueError(
                f"TMC factor of site '{site}' contains NaN: check its distribution's parameters."
            )
        if has_posinf:
            raise ValueError(f"TMC factor of site '{site}' contains +inf: check its log density.")
        if all_neginf:
            raise ValueError(
                f"TMC factor of site '{site}' is -inf for every particle: its value has zero "
                "density under the model or the proposal (e.g. a value outside the support)."
            )
    raise ValueError(
        f"The TMC estimate is {estimate.item()}, though every factor is finite somewhere: "
        "no particle combination has positive weight. Try more particles or a better guide."
    )
