"""Particle groups (``infer={"particle_group": ...}``, :func:`pyro_tmc.poutine.particle_group`).

Oracles: a brute-force formula over the group's K shared indices and the other
latents' particles, on the very particles of a draw (read from its traces), float64;
the exact ``log p(x)`` of a jointly Gaussian model for unbiasedness (4 measured
standard errors); the packed dims of the factors for the memory claim.
"""

import importlib.util
import math

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer.autoguide import AutoNormal

import pyro_tmc
from pyro_tmc import IWAE_ELBO, TMC_ELBO
from pyro_tmc.poutine import particle_group
from tests.common import REPO_ROOT

X = torch.tensor([0.9, -0.4, 1.7], dtype=torch.float64)


# -- a global c, and a group {a, b} inside a plate -----------------------------------


def model(x):
    """c ~ N(0, 1); per n: a ~ N(c, 1), b ~ N(a, 1), x ~ N(a + b, 1)."""
    c = pyro.sample("c", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        a = pyro.sample("a", dist.Normal(c, 1.0))
        b = pyro.sample("b", dist.Normal(a, 1.0))
        pyro.sample("x", dist.Normal(a + b, 1.0), obs=x)


#: the guide's parameters: c's, a's, and b's (b ~ N(B_A a + B_C c, S_B))
C_LOC, C_SCALE, A_LOC, A_SCALE, B_A, B_C, B_SCALE = 0.6, 1.1, 0.4, 1.2, 0.6, 0.3, 1.0


def guide(x):
    """c on its own particle dim; a and b in group "g" (b depends on a, in the group, and on c)."""
    c = pyro.sample("c", dist.Normal(C_LOC, C_SCALE))
    with pyro.plate("data", x.shape[-1], dim=-1), particle_group("g"):
        a = pyro.sample("a", dist.Normal(A_LOC, A_SCALE))
        pyro.sample("b", dist.Normal(B_A * a + B_C * c, B_SCALE))


def exact_log_evidence(x) -> torch.Tensor:
    """x_n = 2c + 2e_a + e_b + e_x: covariance 6 I + 4 (one, one)."""
    n = x.shape[-1]
    cov = 6.0 * torch.eye(n, dtype=x.dtype) + 4.0 * torch.ones(n, n, dtype=x.dtype)
    return dist.MultivariateNormal(torch.zeros(n, dtype=x.dtype), cov).log_prob(x)


def particles(draw, name: str) -> torch.Tensor:
    """A latent's particles as drawn: (K,) for c, (K, N) for the group's members."""
    return draw.guide_trace.nodes[name]["value"].squeeze()


def brute_force(a, b, c, x, proposal="mixture"):
    """
    log P_TMC summed by hand: mean over c's particles j of its weight times, per
    data point n, the mean over the group's shared index k of a's and b's weights.
    b's proposal density given all of c's particles: the mixture over them, or
    for ``"diagonal"`` the one of the same index k. Also the posterior marginal of
    the group's index k, per data point.
    """
    normal = dist.Normal
    log_w_c = normal(0.0, 1.0).log_prob(c) - normal(C_LOC, C_SCALE).log_prob(c)  # (J,)
    cj = c[:, None, None]  # (J, K, N)
    if proposal == "diagonal":
        log_q_b = normal(B_A * a + B_C * c[:, None], B_SCALE).log_prob(b)  # (K, N)
    else:
        log_q_b = normal(B_A * a + B_C * cj, B_SCALE).log_prob(b).logsumexp(0) - math.log(len(c))
    log_w_group = (
        normal(cj, 1.0).log_prob(a)
        + normal(a, 1.0).log_prob(b)
        + normal(a + b, 1.0).log_prob(x)
        - normal(A_LOC, A_SCALE).log_prob(a)
        - log_q_b
    )  # (J, K, N)
    per_point = log_w_group.logsumexp(1) - math.log(a.shape[0])  # (J, N)
    per_c = log_w_c + per_point.sum(-1)  # (J,)
    log_p = per_c.logsumexp(0) - math.log(len(c))
    # the group's marginal at point n: sum over j of c's weight times the other points' sums
    # times this point's term at k, normalised
    others = per_c[:, None] - per_point  # (J, N)
    log_joint = log_w_group + others[:, None, :]  # (J, K, N)
    marginal_k = (log_joint.logsumexp(0) - log_joint.logsumexp((0, 1))).exp()  # (K, N)
    return log_p, marginal_k


@pytest.mark.parametrize("num_samples,proposal", [(2, "mixture"), (3, "mixture"), (3, "diagonal")])
def test_estimate_equals_brute_force_over_shared_indices(float64, num_samples, proposal):
    pyro.set_rng_seed(0)
    elbo = TMC_ELBO(num_samples=num_samples, max_plate_nesting=1, proposal=proposal)
    draw = elbo.draw(model, guide, X)
    a, b, c = (particles(draw, name) for name in "abc")
    assert a.shape == b.shape == (num_samples, 3) and c.shape == (num_samples,)
    expected, marginal_k = brute_force(a, b, c, X, proposal)
    assert torch.allclose(draw.log_estimate(), expected, rtol=0, atol=1e-10)
    # one particle dim for the pair: the members' marginals are the group's, equal
    marginals = draw.marginals()
    for name in "ab":
        weights = marginals[name].log_weights.exp()  # (N, K)
        assert torch.allclose(weights.T, marginal_k, atol=1e-10)


def test_group_counts_log_k_once(float64):
    """Grouped, a and b are one average over K: not K^2 (ungrouped) nor K^-2 (log K twice)."""
    pyro.set_rng_seed(1)
    draw = TMC_ELBO(num_samples=3, max_plate_nesting=1).draw(model, guide, X)
    groups = {name: draw.guide_trace.nodes[name]["infer"]["_tmc_draw"] for name in "ab"}
    assert groups["a"].group == groups["b"].group == "g"
    assert [groups["a"].counts_log_k, groups["b"].counts_log_k] == [True, False]
    assert groups["a"].target_dim == groups["b"].target_dim


def test_unbiased_on_a_gaussian_model(float64):
    """E[P_TMC] = p(x): the ratio P_TMC / p(x) has mean 1 within 4 measured standard errors."""
    pyro.set_rng_seed(2)
    elbo = TMC_ELBO(num_samples=3, max_plate_nesting=1)
    log_p = exact_log_evidence(X)
    ratios = torch.stack([(elbo.log_evidence(model, guide, X) - log_p).exp() for _ in range(1500)])
    mean, se = ratios.mean().item(), (ratios.std() / math.sqrt(len(ratios))).item()
    assert abs(mean - 1.0) < 4 * se, (mean, se)
    assert se < 0.1  # the test has power: an estimate off by K (log K twice) is far outside


def test_sample_posterior_draws_members_together(float64):
    """A joint draw picks one shared index k per data point: a's and b's particles k together."""
    pyro.set_rng_seed(3)
    draw = TMC_ELBO(num_samples=3, max_plate_nesting=1).draw(model, guide, X)
    a, b = particles(draw, "a"), particles(draw, "b")
    samples = draw.sample(50)
    assert samples["a"].shape == samples["b"].shape == (50, 3)
    k_a = (samples["a"][:, None, :] == a[None]).double().argmax(1)  # (draws, N)
    k_b = (samples["b"][:, None, :] == b[None]).double().argmax(1)
    assert torch.equal(k_a, k_b)
    assert (samples["a"][:, None, :] == a[None]).any(1).all()
    assert len(set(k_a.flatten().tolist())) > 1  # not always particle 0


# -- memory: four members, one particle dim --------------------------------------------


def four_parent_model(x):
    with pyro.plate("data", x.shape[-1], dim=-1):
        z = [pyro.sample(f"z{i}", dist.Normal(0.0, 1.0)) for i in range(4)]
        pyro.sample("x", dist.Normal(z[0] + z[1] * z[2] - z[3], 1.0), obs=x)


def four_parent_guide(x, grouped=True):
    with pyro.plate("data", x.shape[-1], dim=-1):
        for i in range(4):
            infer = {"particle_group": "z"} if grouped else {}
            pyro.sample(f"z{i}", dist.Normal(0.1 * i, 1.0), infer=infer)


def particle_symbols_of(draw, site: str) -> set:
    """The particle (non-plate) symbols of the packed log p factor of ``site``."""
    plates = set(draw.model_trace.plate_to_symbol.values())
    (term,) = [f.term for f in draw.factors() if f.site == site][:1]
    return set(term._pyro_dims) - plates


@pytest.mark.parametrize("grouped", [True, False])
def test_four_member_parents_make_one_particle_dim(float64, grouped):
    pyro.set_rng_seed(4)
    elbo = TMC_ELBO(num_samples=3, max_plate_nesting=1)
    draw = elbo.draw(four_parent_model, lambda x: four_parent_guide(x, grouped), X)
    symbols = particle_symbols_of(draw, "x")
    assert len(symbols) == (1 if grouped else 4)
    log_p_x = [f.term for f in draw.factors() if f.site == "x"][0]
    assert log_p_x.numel() == 3 * (3 if grouped else 3**4)
    dims = {draw.model_trace.nodes[f"z{i}"]["infer"]["_enumerate_dim"] for i in range(4)}
    assert len(dims) == (1 if grouped else 4)
    assert torch.isfinite(draw.log_estimate())


# -- model-only latents, and the handler --------------------------------------------------


def test_model_only_latent_joins_the_guides_group(float64):
    """A latent the guide lacks, marked in the model, shares the guide's group dim."""

    def model_with_own_latent(x):
        with pyro.plate("data", x.shape[-1], dim=-1):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
            d = pyro.sample("d", dist.Normal(a, 1.0), infer={"particle_group": "g"})
            pyro.sample("x", dist.Normal(a + d, 1.0), obs=x)

    def guide_a(x):
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("a", dist.Normal(0.3, 1.1), infer={"particle_group": "g"})

    pyro.set_rng_seed(5)
    draw = TMC_ELBO(num_samples=3, max_plate_nesting=1).draw(model_with_own_latent, guide_a, X)
    nodes = draw.model_trace.nodes
    assert nodes["d"]["infer"]["_enumerate_dim"] == nodes["a"]["infer"]["_enumerate_dim"]
    assert not nodes["d"]["infer"]["_tmc_draw"].counts_log_k
    # brute force: d's proposal is its prior given a^k, so it cancels: mean_k w_a(k) p(x | a_k, d_k)
    a, d = nodes["a"]["value"].squeeze(), nodes["d"]["value"].squeeze()
    log_w = dist.Normal(0.0, 1.0).log_prob(a) - dist.Normal(0.3, 1.1).log_prob(a)
    log_w = log_w + dist.Normal(a + d, 1.0).log_prob(X)
    expected = (log_w.logsumexp(0) - math.log(3)).sum()
    assert torch.allclose(draw.log_estimate(), expected, atol=1e-10)


def test_handler_sets_the_key_and_respects_explicit_groups():
    def guide_in_handler():
        with particle_group("outer"):
            pyro.sample("a", dist.Normal(0.0, 1.0))
            pyro.sample("b", dist.Normal(0.0, 1.0), infer={"particle_group": "own"})
            with particle_group("inner"):
                pyro.sample("c", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(0.0, 1.0), obs=torch.tensor(0.0))

    trace = pyro.poutine.trace(guide_in_handler).get_trace()
    groups = {
        name: site["infer"].get("particle_group")
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
    }
    assert groups == {"a": "outer", "b": "own", "c": "inner", "y": None}
    assert pyro_tmc.poutine.particle_group is particle_group


def test_autonormal_grouped_by_its_auxiliary_sites(float64):
    pyro.set_rng_seed(6)
    names = [f"z{i}_unconstrained" for i in range(4)]
    guide_ = particle_group("z", sites=names)(AutoNormal(four_parent_model))
    elbo = TMC_ELBO(num_samples=3, max_plate_nesting=1)
    draw = elbo.draw(four_parent_model, guide_, X)
    assert len(particle_symbols_of(draw, "x")) == 1
    samples = draw.sample(5)
    assert samples["z0"].shape == (5, 3)
    # the Delta sites read their auxiliary sites' particles: one index for all four
    values = {f"z{i}": draw.model_trace.nodes[f"z{i}"]["value"].squeeze() for i in range(4)}  # (K, N)
    picked = [(samples[name][:, None, :] == value[None]).double().argmax(1) for name, value in values.items()]
    assert all(torch.equal(picked[0], k) for k in picked[1:])
    marginals = draw.marginals()
    assert all(torch.allclose(marginals["z0"].log_weights, marginals[n].log_weights) for n in values)


def test_iwae_ignores_groups(float64):
    """IWAE already shares one dim among all latents: a group changes nothing."""
    pyro.set_rng_seed(7)
    assert math.isfinite(IWAE_ELBO(num_samples=3, max_plate_nesting=1).loss(model, guide, X))


# -- errors ---------------------------------------------------------------------------------


def test_error_on_different_num_samples():
    def bad_guide(x):
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("a", dist.Normal(0.0, 1.0), infer={"particle_group": "g", "num_samples": 2})
            pyro.sample("b", dist.Normal(0.0, 1.0), infer={"particle_group": "g"})

    with pytest.raises(ValueError, match=r"'a' and 'b' are in particle group 'g' but ask for 2 and 3"):
        TMC_ELBO(num_samples=3, max_plate_nesting=1).loss(model, bad_guide, X)


def test_error_on_different_plates():
    def bad_guide(x):
        c = pyro.sample("c", dist.Normal(0.0, 1.0), infer={"particle_group": "g"})
        with pyro.plate("data", x.shape[-1], dim=-1):
            a = pyro.sample("a", dist.Normal(c, 1.0), infer={"particle_group": "g"})
            pyro.sample("b", dist.Normal(a, 1.0))

    with pytest.raises(ValueError, match=r"'c' and 'a' .* different plates \(no plate and plates 'data'\)"):
        TMC_ELBO(num_samples=3, max_plate_nesting=1).loss(model, bad_guide, X)


def test_error_on_enumerated_member():
    def discrete_model():
        z = pyro.sample("z", dist.Bernoulli(0.3), infer={"enumerate": "parallel", "particle_group": "g"})
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.5))

    with pytest.raises(ValueError, match=r"Site 'z' is marked .*'enumerate'.* particle group 'g'"):
        TMC_ELBO(num_samples=3, max_plate_nesting=0).loss(discrete_model, lambda: None)


def test_error_on_model_group_the_guide_does_not_draw():
    def marked_model(x):
        c = pyro.sample("c", dist.Normal(0.0, 1.0), infer={"particle_group": "g"})
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("x", dist.Normal(c, 1.0), obs=x)

    def plain_guide(x):
        pyro.sample("c", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match=r"Site 'c' sets infer\['particle_group'\] = 'g' in the model"):
        TMC_ELBO(num_samples=3, max_plate_nesting=1).loss(marked_model, plain_guide, X)


def test_model_key_on_autonormal_sites_checked_against_the_guide(float64):
    """The model may repeat a group the guide draws (through AutoNormal's auxiliary sites), not add one."""

    def marked_model(x):
        with pyro.plate("data", x.shape[-1], dim=-1), particle_group("z"):
            z = [pyro.sample(f"z{i}", dist.Normal(0.0, 1.0)) for i in range(4)]
            pyro.sample("x", dist.Normal(z[0] + z[1] * z[2] - z[3], 1.0), obs=x)

    names = [f"z{i}_unconstrained" for i in range(4)]
    elbo = TMC_ELBO(num_samples=3, max_plate_nesting=1)
    grouped = particle_group("z", sites=names)(AutoNormal(marked_model))
    assert math.isfinite(elbo.loss(marked_model, grouped, X))
    pyro.clear_param_store()
    with pytest.raises(ValueError, match=r"Site 'z0' .* group its site 'z0_unconstrained'"):
        elbo.loss(marked_model, AutoNormal(marked_model), X)


def test_error_on_a_group_not_named_by_a_string():
    with pytest.raises(ValueError, match="named by a string"):
        particle_group(3)

    def bad_guide(x):
        pyro.sample("c", dist.Normal(0.0, 1.0), infer={"particle_group": 1})

    def model_c(x):
        pyro.sample("c", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match=r"Site 'c' sets infer\['particle_group'\] = 1"):
        TMC_ELBO(num_samples=3, max_plate_nesting=1).loss(model_c, bad_guide, X)


# -- radon at K=30 ------------------------------------------------------------------------------


def test_radon_at_k30_runs_with_its_state_latents_grouped(fresh_pyro):
    """alan's radon model, AutoNormal's four per-state auxiliary sites in one group: at K=30 the
    observation factor has one particle dim (30 x 600 elements, not 30^4 x 600)."""
    script = REPO_ROOT / "benchmarks" / "particle_groups.py"
    spec = importlib.util.spec_from_file_location("particle_groups_benchmark", script)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    data = benchmark.load("radon")
    guide_ = benchmark.make_guide(data.model, grouped=True)
    elbo = TMC_ELBO(num_samples=30, max_plate_nesting=data.max_plate_nesting)
    svi = pyro.infer.SVI(data.model, guide_, pyro.optim.Adam({"lr": 0.1}), elbo)
    assert all(math.isfinite(svi.step(*data.train)) for _ in range(2))
    draw = elbo.draw(data.model, guide_, *data.train)
    assert len(particle_symbols_of(draw, "log_radon")) == 1
    (log_p,) = [f.term for f in draw.factors() if f.site == "log_radon"]
    assert log_p.numel() == 30 * 600


# -- a group along a markov chain, and the compiled path -------------------------------------

CHAIN_X = torch.tensor([0.3, -1.1, 0.8, 1.5], dtype=torch.float64)


def chain_model(x):
    z = 0.0
    for t in pyro.markov(range(len(x))):
        z = pyro.sample(f"z_{t}", dist.Normal(0.9 * z, 1.0))
        pyro.sample(f"x_{t}", dist.Normal(z, 0.5), obs=x[t])


def chain_guide(x):
    z = 0.0
    for t in pyro.markov(range(len(x))):
        z = pyro.sample(f"z_{t}", dist.Normal(0.5 * z + 0.2, 1.2), infer={"particle_group": "chain"})


def test_group_along_a_markov_chain_is_iwae_on_the_chain(float64):
    """Every z_t on one dim: log mean_k prod_t p(z_t^k | z_t-1^k) p(x_t | z_t^k) / q(z_t^k | z_t-1^k)."""
    pyro.set_rng_seed(8)
    draw = TMC_ELBO(num_samples=4, max_plate_nesting=0).draw(chain_model, chain_guide, CHAIN_X)
    z = torch.stack([particles(draw, f"z_{t}") for t in range(len(CHAIN_X))])  # (T, K)
    previous = torch.cat([torch.zeros_like(z[:1]), z[:-1]])
    log_w = (
        dist.Normal(0.9 * previous, 1.0).log_prob(z)
        + dist.Normal(z, 0.5).log_prob(CHAIN_X[:, None])
        - dist.Normal(0.5 * previous + 0.2, 1.2).log_prob(z)
    ).sum(0)
    expected = log_w.logsumexp(0) - math.log(4)
    assert torch.allclose(draw.log_estimate(), expected, atol=1e-10)


def test_compiled_graph_equals_eager_with_groups(float64):
    losses = {}
    for compile in (None, "graph"):
        pyro.set_rng_seed(9)
        elbo = TMC_ELBO(num_samples=3, max_plate_nesting=1, compile=compile)
        losses[compile] = [elbo.loss(model, guide, X) for _ in range(3)]
    assert losses[None] == pytest.approx(losses["graph"], abs=1e-10)
