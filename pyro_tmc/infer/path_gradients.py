r"""Path-gradient estimators for the guide: sticking the landing (STL) and DReGs.

Both keep the *value* of the bound and the generative parameters' gradient, and
change only how the guide's parameters phi are differentiated. Write the bound
as ``F(z, phi)``: a function of the guide's reparameterised particles
``z = T(eps; phi, parents)`` and, directly, of phi through the guide's density.
The plain gradient is

    dF/dphi = sum_{j,k} dF/dz_j^k . dz_j^k/dphi   +   dF/dphi|_direct
              \_____________ path ____________/       \___ score ___/

The score term has zero mean for a single sample but is noisy.

- **STL** (Roeder et al. 2017) drops the score term: the guide's gradient is the
  path term alone. We compute it as ``sum stop(dF/dz) . z``, with ``dF/dz`` the
  partial derivative with respect to each particle's value as an independent
  leaf (re-running the guide on detached copies of its particles). For a
  factorised guide this equals "evaluate the guide's density with detached
  parameters"; for a non-factorised one it also keeps the path through a child's
  density's dependence on its parents, which detaching parameters would lose.

- **DReGs** (Tucker et al. 2018) rewrites the score term with the
  reparameterisation identity ``E[f(z) d log q(z)/dphi] = E[df/dz . dz/dphi]``.
  For TMC the score term is ``-sum_{j,k} m_j^k d log q_j(z_j^k)/dphi``, where
  ``m_j^k = A_j^k / sum A`` is the posterior marginal weight of particle k of
  site j and ``A_j^k`` the summed weight of every combination that contains it.
  For a factorised guide, only the combinations containing z_j^k depend on it,
  so ``dF/dz_j^k = m_j^k d log A_j^k/dz_j^k`` and, by the identity,

      E[m d log q/dphi] = E[dm/dz . dz/dphi] = E[m (d log A/dz - dF/dz) . dz/dphi].

  Adding the path term, particle (j, k) contributes
  ``(m - m + m^2) d log A/dz = m^2 d log A/dz = m . dF/dz`` times ``dz/dphi``:

      grad_phi = sum_{j,k} m_j^k (dF/dz_j^k) dz_j^k/dphi,

  each particle's path gradient weighted by its own marginal. With one latent,
  ``m_k = w_k / sum w`` and this is IWAE-DReGs. The paper's surrogate
  ``1/2 (sum wbar^2 / (sum wbar)^2) log sum what^2`` squares whole-combination
  weights instead, which with several latents shrinks each latent's gradient by
  the other latents' effective sample size: biased. Ours is computed in log
  space from ``dF/dz`` and ``m = dF/d(source)`` (a zero tensor added to each
  site's factor), both by one backward pass through the contraction.

  When a guide site's proposal depends on upstream particles, moving z_j^k also
  moves the combinations that hold its descendants, and this weighting is no
  longer exact: DReGs then raises ``NotImplementedError`` naming the site.
"""

from typing import Optional

import torch

from pyro.poutine import Trace

from pyro_tmc.poutine.sites import is_drawn, is_point_mass_latent, particle_draw


def reparameterised_latents(guide_trace: Trace, estimator: str) -> list[str]:
    """
    Names of the guide's sampled latent sites, which a path-gradient estimator
    differentiates through.

    :raises NotImplementedError: naming a site that is not reparameterisable.
    """
    names = []
    for name, site in guide_trace.nodes.items():
        if not is_drawn(site):
            continue  # summed exactly (no density, no path), or a plate's subsample
        if not site["fn"].has_rsample:
            raise NotImplementedError(
                f"variance_reduction={estimator!r} needs reparameterised guide sites, but site "
                f"'{name}' ({type(site['fn']).__name__}) is not. Use variance_reduction=None "
                "(score-function terms) or pyro_tmc.TMC_RWS for discrete latents."
            )
        names.append(name)
    return names


def check_factorised(guide_trace: Trace, names: list[str]) -> None:
    """:raises NotImplementedError: if a guide site's proposal depends on upstream particles (DReGs)."""
    for name in names:
        draw = particle_draw(guide_trace.nodes[name])
        if draw is not None and draw.parent_dims:
            raise NotImplementedError(
                f"variance_reduction='dregs' is exact only for guides whose sites do not depend "
                f"on upstream particles, but site '{name}' does. Use variance_reduction='stl' "
                "or None for this guide."
            )


def with_leaf_values(
    guide_trace: Trace, names: list[str], requires_grad: bool = True
) -> tuple[Trace, dict[str, torch.Tensor]]:
    """
    A copy of ``guide_trace`` whose latent values are detached leaves (that
    require grad, by default), to be replayed so that every density is
    recomputed from them. Delta sites (no particle dim of their own) are left
    out, so that the replay recomputes them from the leaves they depend on
    (AutoNormal's constrained values from its auxiliary particles).
    """
    leaves = {name: guide_trace.nodes[name]["value"].detach().requires_grad_(requires_grad) for name in names}
    leaf_trace = guide_trace.copy()
    for name, leaf in leaves.items():
        node = dict(guide_trace.nodes[name])
        node["value"] = leaf
        leaf_trace.nodes[name] = node
    for name, site in guide_trace.nodes.items():
        if name not in leaves and is_point_mass_latent(site):
            leaf_trace.remove_node(name)
    return leaf_trace, leaves


def path_surrogate(
    live_values: dict[str, torch.Tensor],
    value_grads: dict[str, Optional[torch.Tensor]],
    weights: Optional[dict[str, torch.Tensor]] = None,
    event_dims: Optional[dict[str, int]] = None,
) -> torch.Tensor:
    """
    ``sum_j stop(w_j * dF/dz_j) . z_j`` minus its own value: zero-valued, its
    gradient is the (weighted) path gradient through the live particle values.

    :param dict live_values: site -> particles as drawn (differentiable in phi).
    :param dict value_grads: site -> dF/dz at the leaf copies (None if unused).
    :param dict weights: site -> per-particle weights (broadcast over event dims).
    :param dict event_dims: site -> event dim of the site's distribution.
    """
    total = 0.0
    for name, value in live_values.items():
        grad = value_grads.get(name)
        if grad is None or not value.requires_grad:
            continue
        if weights is not None:
            weight = weights[name]
            weight = weight.reshape(weight.shape + (1,) * event_dims[name])
            grad = grad * weight
        term = (grad.detach() * value).sum()
        total = total + term - term.detach()
    return total
