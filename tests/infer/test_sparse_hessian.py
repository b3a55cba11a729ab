"""The sparse Hessian of a model's log joint (pyro_tmc.infer.sparse_hessian) against the one row by row."""

import pytest
import torch

import pyro
import pyro.distributions as dist

from pyro_tmc.infer.adaptive_proposal import AdaptiveProposal
from pyro_tmc.infer.laplace import LogJoint, _derivatives, _scored, proposal_mean, split_coordinates
from pyro_tmc.infer.sparse_hessian import greedy_colours, hessian_pattern, nonzero_structure
from tests.common.adaptation_models import FUNNEL_Y, funnel_model

pytestmark = pytest.mark.quick

RETURNS = torch.tensor([0.3, -1.2, 0.8, 2.1, -0.4, 0.1, -0.9, 1.6, 0.2, -0.3, 1.1, -2.0])
EFFECTS = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.5])
SCHOOLS = torch.tensor(FUNNEL_Y)  # eight schools: a plate of locals on two globals


def volatility(returns):
    """A pyro.markov AR(1) log volatility with three globals: a chain's band beside dense globals."""
    persistence = pyro.sample("persistence", dist.Uniform(-1.0, 1.0))
    mean = pyro.sample("mean", dist.Normal(0.0, 2.0))
    shock = pyro.sample("shock", dist.HalfNormal(1.0))
    x = mean
    for t in pyro.markov(range(len(returns))):
        x = pyro.sample(f"x_{t}", dist.Normal(mean + persistence * (x - mean), shock))
        pyro.sample(f"r_{t}", dist.Normal(0.0, (x / 2).exp()), obs=returns[t])


def crossed(effects):
    """Two plates' locals that one factor reads crosswise: the pattern must not call them apart."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    rows, columns = pyro.plate("rows", 3, dim=-2), pyro.plate("columns", len(effects), dim=-1)
    with rows:
        a = pyro.sample("a", dist.Normal(mu, 1.0))
    with columns:
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with rows, columns:
        pyro.sample("y", dist.Normal(a * b + mu, 1.0), obs=effects.expand(3, len(effects)))


def flipped(effects):
    """A factor in the plate that reads another index of its site: the plates' word is wrong here."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("schools", len(effects)):
        theta = pyro.sample("theta", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(theta * theta.flip(-1), 1.0), obs=effects)


def setting(model, data, nesting):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    proposal = AdaptiveProposal(model, data, max_plate_nesting=nesting)
    torch.manual_seed(1)
    point = proposal_mean(proposal).double() + 0.3 * torch.randn(len(proposal_mean(proposal))).double()
    pattern = hessian_pattern(model, proposal, split_coordinates(proposal, point), (data,), {}, _scored)
    return proposal, point, pattern


def row_by_row(model, proposal, data, point):
    return _derivatives(LogJoint(model, proposal, (data,), {}, None, None), point)[2]


@pytest.mark.parametrize(
    "model, data, nesting, most_passes",
    [
        (volatility, RETURNS, 0, 3 + 4 + 1),
        (funnel_model, SCHOOLS, 1, 2 + 1 + 1),
        (crossed, EFFECTS, 2, 1 + 3 + 1 + 1),
    ],
    ids=["markov chain", "plate", "crossed plates"],
)
def test_the_coloured_hessian_is_the_row_by_row_one(model, data, nesting, most_passes):
    """
    From the dense columns and a product per colour, the Hessian equals the one read row by row, in
    fewer passes than one per coordinate: the chain's 15 coordinates in 3 global columns and at most
    4 colours of days (a band's distance-2 colouring needs 3), the plate's 10 in 2 columns and one
    colour, the crossed plates' 9 in the global's and the rows' columns and one colour of columns.
    """
    proposal, point, pattern = setting(model, data, nesting)
    assert pattern is not None and pattern.passes <= most_passes < len(point)
    density = LogJoint(model, proposal, (data,), {}, None, pattern)
    got = _derivatives(density, point)[2]
    assert density.pattern is pattern  # its check passed: not dropped for rows
    expected = row_by_row(model, proposal, data, point)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_a_structure_the_plates_misstate_is_caught_and_read_row_by_row():
    """
    ``theta * theta.flip(-1)`` couples schools the plate calls apart: the structure misses the
    entries, the check against a random product finds it, and the Hessian is read row by row.
    """
    proposal, point, pattern = setting(flipped, EFFECTS, 1)
    assert pattern is not None
    density = LogJoint(flipped, proposal, (EFFECTS,), {}, None, pattern)
    got = _derivatives(density, point)[2]
    assert density.pattern is None
    expected = row_by_row(flipped, proposal, EFFECTS, point)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert expected[1, 5].abs() > 1e-3  # school 0 meets school 4: the entry the plate's word misses


def test_the_structure_covers_every_nonzero_entry_of_the_chain():
    """
    Every entry of the chain's row-by-row Hessian that is not zero is in the structure, and no more:
    its band (days one apart), every global's row and column, and each day's own.
    """
    proposal, point, _ = setting(volatility, RETURNS, 0)
    coordinates = split_coordinates(proposal, point)
    structure = nonzero_structure(volatility, proposal, coordinates, (RETURNS,), {}, _scored)
    expected = row_by_row(volatility, proposal, RETURNS, point)
    assert not ((expected.abs() > 1e-9) & ~structure).any()
    days = torch.arange(len(RETURNS))
    band = (days.unsqueeze(-1) - days).abs() <= 1
    assert torch.equal(structure[3:, 3:], band)
    assert structure[:3].all() and structure[:, :3].all()


def test_greedy_colours_never_share_a_colour_between_conflicting_columns():
    """On random symmetric conflicts, no two conflicting columns get one colour, and colours are few."""
    generator = torch.Generator().manual_seed(0)
    for density in (0.05, 0.3):
        conflicts = torch.rand(60, 60, generator=generator) < density
        conflicts = conflicts | conflicts.T | torch.eye(60, dtype=torch.bool)
        colours = greedy_colours(conflicts)
        same = colours.unsqueeze(-1) == colours
        assert not (same & conflicts & ~torch.eye(60, dtype=torch.bool)).any()
        assert int(colours.max()) + 1 <= int(conflicts.sum(-1).max())  # at most 1 + the largest degree
