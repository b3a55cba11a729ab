"""Models and guides written the way Pyro users write them, for ``test_pyro_style_models.py``.

Nothing here imports ``pyro_tmc``: the models are plain Pyro programs (AutoGuides,
``config_enumerate``, ``pyro.markov``, ``Vindex``, ``poutine.mask`` / ``block``), and
the closed-form oracles are computed independently of the code under test.

Contents
--------
* conjugate models with a closed-form ``log p(x)`` for the AutoGuide checks:
  :func:`normal_plate_model`, :func:`lognormal_model` (a constrained latent, so the
  AutoGuides' Delta sites carry a log-Jacobian), :func:`mvn_model` (a correlated 2-D
  latent), :func:`global_local_model` (a global with a Delta guide and locals with the
  hand-written :class:`GlobalLocalLocalGuide`, both in an ``AutoGuideList``);
* HMMs with enumerated hidden states and AutoDelta globals: :func:`categorical_hmm`,
  :func:`factorial_hmm`, :func:`second_order_hmm`, :func:`padded_hmm` (+ a forward
  algorithm oracle, :func:`padded_hmm_log_joint`);
* LDA with nested plates: :func:`lda_model`, :func:`lda_map_guide`,
  :func:`lda_dirichlet_guide` and a brute-force oracle :func:`lda_log_joint`;
* a tiny VAE: :class:`TinyVAE`;
* Gaussian mixtures: :func:`gmm_model` (everything global MAP) and
  :func:`gmm_sampled_locs_model` (locations with a Normal guide) with the oracle
  :func:`gmm_sampled_locs_log_joint`. Sampled (particle-carrying) locations are one
  vector site read with ``Vindex(locs)[..., assignment]``: inside a ``components``
  plate their particle dims would sit left of the component axis and misalign with
  the data plate, as with Pyro's own vectorised particles.
"""

import itertools
import math

import torch
from torch import nn
from torch.distributions import constraints

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer import config_enumerate
from pyro.infer.autoguide import AutoDelta, AutoGuide
from pyro.ops.indexing import Vindex


def _normal_logpdf(x, mean, cov):
    """log N(x; mean, cov) in float64 (a vector x)."""
    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1)
    mean = torch.as_tensor(mean, dtype=torch.float64).expand(x.shape)
    cov = torch.as_tensor(cov, dtype=torch.float64)
    return torch.distributions.MultivariateNormal(mean, cov).log_prob(x).item()


# --------------------------------------------------------------------------- #
# Conjugate models (closed-form evidence)
# --------------------------------------------------------------------------- #
def normal_plate_model(x):
    """z_i ~ N(0, 1), x_i ~ N(z_i, 1) independently: p(x) = prod_i N(x_i; 0, 2)."""
    with pyro.plate("data", len(x)):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def normal_plate_log_evidence(x):
    return dist.Normal(0.0, math.sqrt(2.0)).log_prob(x.double()).sum().item()


def normal_plate_posterior_mean(x):
    return x / 2


LOGNORMAL_NOISE = 0.5


def lognormal_model(x):
    """A positive global: z ~ LogNormal(0, 1), x_i ~ LogNormal(log z, s).

    In log space u = log z ~ N(0, 1) and log x_i = u + s e_i, so log x ~ N(0, 11^T + s^2 I)
    and p(x) = N(log x; 0, 11^T + s^2 I) / prod_i x_i.
    """
    z = pyro.sample("z", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.LogNormal(torch.log(z), LOGNORMAL_NOISE), obs=x)


def lognormal_log_evidence(x):
    n = len(x)
    cov = torch.ones(n, n, dtype=torch.float64) + LOGNORMAL_NOISE**2 * torch.eye(n, dtype=torch.float64)
    logx = torch.log(x.double())
    return _normal_logpdf(logx, 0.0, cov) - logx.sum().item()


def lognormal_posterior_log_mean(x):
    """Posterior mean of u = log z: sum(log x) / s^2 / (1 + n / s^2)."""
    precision = 1.0 + len(x) / LOGNORMAL_NOISE**2
    return (torch.log(x).sum() / LOGNORMAL_NOISE**2 / precision).item()


MVN_PRIOR_COV = torch.tensor([[1.0, 0.6], [0.6, 1.0]])
MVN_NOISE_COV = torch.tensor([[0.5, 0.2], [0.2, 0.5]])
# Cholesky factors computed once (each MultivariateNormal(covariance_matrix=...) would
# factorise again on every call).
_MVN_PRIOR_TRIL = torch.linalg.cholesky(MVN_PRIOR_COV)
_MVN_NOISE_TRIL = torch.linalg.cholesky(MVN_NOISE_COV)


def mvn_model(x):
    """A correlated 2-D latent: z ~ MVN(0, S0), x_j ~ MVN(z, R) for the rows x_j of x.

    vec(x) ~ N(0, 11^T (x) S0 + I (x) R) (Kronecker products).
    """
    z = pyro.sample("z", dist.MultivariateNormal(torch.zeros(2), scale_tril=_MVN_PRIOR_TRIL))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("x", dist.MultivariateNormal(z, scale_tril=_MVN_NOISE_TRIL), obs=x)


def mvn_log_evidence(x):
    n = x.shape[0]
    s0, r = MVN_PRIOR_COV.double(), MVN_NOISE_COV.double()
    cov = torch.kron(torch.ones(n, n, dtype=torch.float64), s0) + torch.kron(
        torch.eye(n, dtype=torch.float64), r
    )
    return _normal_logpdf(x.reshape(-1), 0.0, cov)


def mvn_posterior_mean(x):
    s0_inv, r_inv = torch.linalg.inv(MVN_PRIOR_COV), torch.linalg.inv(MVN_NOISE_COV)
    precision = s0_inv + x.shape[0] * r_inv
    return torch.linalg.solve(precision, r_inv @ x.sum(0))


GL_PRIOR_SCALE = 2.0
GL_NOISE = 0.5


def global_local_model(x):
    """mu ~ N(0, 2^2); z_i ~ N(mu, 1); x_i ~ N(z_i, 0.5^2).

    For a fixed mu: p(x, mu) = N(mu; 0, 4) prod_i N(x_i; mu, 1 + 0.25), and the exact
    posterior of z_i is N((mu + 4 x_i) / 5, 1 / 5).
    """
    mu = pyro.sample("mu", dist.Normal(0.0, GL_PRIOR_SCALE))
    with pyro.plate("data", len(x)):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, GL_NOISE), obs=x)


def global_local_log_joint(x, mu):
    """log p(x, mu) with z integrated out."""
    mu = torch.as_tensor(mu, dtype=torch.float64)
    return (
        dist.Normal(0.0, GL_PRIOR_SCALE).log_prob(mu)
        + dist.Normal(mu, math.sqrt(1.0 + GL_NOISE**2)).log_prob(x.double()).sum()
    ).item()


class GlobalLocalLocalGuide(AutoGuide):
    """A hand-written guide for the locals z of :func:`global_local_model`, to sit in an
    :class:`~pyro.infer.autoguide.AutoGuideList` beside an AutoDelta on mu.

    Written as an ``AutoGuide`` subclass, as Pyro advises for partial guides that need the
    model's plates (a bare callable opening its own ``pyro.plate("data")`` would duplicate
    the plate the list creates). With ``mu`` given it is the exact posterior of z given
    that mu, N((mu + 4 x_i) / 5, 1 / 5); otherwise a learnable mean-field Normal,
    initialised at 0.8 x with scale 0.7 (wider than the posterior's 0.45).
    """

    def __init__(self, model, mu=None):
        super().__init__(poutine.block(model, expose=["z"]))
        self.mu = mu

    def forward(self, x):
        if self.prototype_trace is None:
            self._setup_prototype(x)
        plates = self._create_plates(x)
        if self.mu is None:
            loc = pyro.param("local_loc", lambda: 0.8 * x.detach().clone())
            scale = pyro.param(
                "local_scale", lambda: torch.full_like(x, 0.7), constraint=constraints.positive
            )
        else:
            precision = 1.0 + 1.0 / GL_NOISE**2
            loc, scale = (self.mu + x / GL_NOISE**2) / precision, torch.full_like(x, precision**-0.5)
        with plates["data"]:
            return {"z": pyro.sample("z", dist.Normal(loc, scale))}


# --------------------------------------------------------------------------- #
# HMMs: discrete hidden states enumerated, globals MAP (AutoDelta)
# --------------------------------------------------------------------------- #
def _sticky_dirichlet(num_states, stay=2.0, move=0.5):
    return dist.Dirichlet(move + (stay - move) * torch.eye(num_states)).to_event(1)


@config_enumerate
def categorical_hmm(observations, num_states=3, vocab_size=4):
    """First-order HMM over symbol sequences ``observations`` (num_sequences, T), long.

    Globals: an initial distribution, a sticky transition matrix and emission
    probabilities, all with Dirichlet priors; plain integer indexing ``trans[x]``.
    """
    num_sequences, length = observations.shape
    init = pyro.sample("init", dist.Dirichlet(torch.ones(num_states)))
    trans = pyro.sample("trans", _sticky_dirichlet(num_states))
    emit = pyro.sample("emit", dist.Dirichlet(0.7 * torch.ones(num_states, vocab_size)).to_event(1))
    with pyro.plate("sequences", num_sequences, dim=-1):
        x = None
        for t in pyro.markov(range(length)):
            x = pyro.sample(f"x_{t}", dist.Categorical(init if x is None else trans[x]))
            pyro.sample(f"y_{t}", dist.Categorical(emit[x]), obs=observations[:, t])


@config_enumerate
def factorial_hmm(data, num_w=2, num_x=3):
    """Two independent hidden chains w, x jointly emitting real data (num_sequences, T).

    Transitions and emission means are read with ``Vindex``; the noise scale is a
    positive global.
    """
    num_sequences, length = data.shape
    trans_w = pyro.sample("trans_w", _sticky_dirichlet(num_w))
    trans_x = pyro.sample("trans_x", _sticky_dirichlet(num_x))
    locs = pyro.sample("locs", dist.Normal(0.0, 3.0).expand([num_w, num_x]).to_event(2))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 0.5))
    with pyro.plate("sequences", num_sequences, dim=-1):
        w = x = 0
        for t in pyro.markov(range(length)):
            w = pyro.sample(f"w_{t}", dist.Categorical(Vindex(trans_w)[..., w, :]))
            x = pyro.sample(f"x_{t}", dist.Categorical(Vindex(trans_x)[..., x, :]))
            pyro.sample(f"y_{t}", dist.Normal(Vindex(locs)[..., w, x], scale), obs=data[:, t])


@config_enumerate
def second_order_hmm(sequences, num_states=2):
    """x_t depends on (x_{t-2}, x_{t-1}); binary features (num_sequences, T, D) emitted
    through a features plate nested in the sequences plate."""
    num_sequences, length, data_dim = sequences.shape
    trans = pyro.sample("trans", dist.Dirichlet(torch.ones(num_states, num_states, num_states)).to_event(2))
    probs_y = pyro.sample("probs_y", dist.Beta(1.0, 1.0).expand([num_states, data_dim]).to_event(2))
    features = pyro.plate("features", data_dim, dim=-1)
    with pyro.plate("sequences", num_sequences, dim=-2):
        x_prev, x_curr = 0, 0
        for t in pyro.markov(range(length), history=2):
            x_next = pyro.sample(f"x_{t}", dist.Categorical(Vindex(trans)[..., x_prev, x_curr, :]))
            x_prev, x_curr = x_curr, x_next
            with features:
                pyro.sample(f"y_{t}", dist.Bernoulli(probs_y[x_curr.squeeze(-1)]), obs=sequences[:, t])


PADDED_NUM_STATES = 3


def _padded_priors(num_states, data_dim):
    return (
        _sticky_dirichlet(num_states),
        dist.Normal(0.0, 2.0).expand([num_states, data_dim]).to_event(2),
        dist.HalfNormal(1.0),
    )


@config_enumerate
def padded_hmm(sequences, lengths, batch=None):
    """Padded real sequences (num_sequences, max_length, D) of the given ``lengths``;
    steps past a sequence's length are masked out (hidden state and emission alike).
    ``batch`` optionally subsamples the sequences plate (then scaled by N / len(batch))."""
    num_sequences, max_length, data_dim = sequences.shape
    trans_prior, locs_prior, noise_prior = _padded_priors(PADDED_NUM_STATES, data_dim)
    trans = pyro.sample("trans", trans_prior)
    locs = pyro.sample("locs", locs_prior)
    noise = pyro.sample("noise", noise_prior)
    features = pyro.plate("features", data_dim, dim=-1)
    with pyro.plate("sequences", num_sequences, subsample=batch, dim=-2) as idx:
        seqs, lens = sequences[idx], lengths[idx]
        x = 0
        for t in pyro.markov(range(max_length)):
            with poutine.mask(mask=(t < lens).unsqueeze(-1)):
                x = pyro.sample(f"x_{t}", dist.Categorical(trans[x]))
                with features:
                    pyro.sample(f"y_{t}", dist.Normal(locs[x.squeeze(-1)], noise), obs=seqs[:, t])


def padded_hmm_log_joint(sequences, lengths, trans, locs, noise, batch=None):
    """log p(globals) + (N / B) sum_{sequences in batch} log p(y[:len] | globals), by the
    forward algorithm (float64), independently of any Pyro inference code."""
    num_sequences, _, data_dim = sequences.shape
    trans_prior, locs_prior, noise_prior = _padded_priors(trans.shape[0], data_dim)
    log_prior = trans_prior.log_prob(trans) + locs_prior.log_prob(locs) + noise_prior.log_prob(noise)
    idx = torch.arange(num_sequences) if batch is None else batch
    log_trans = trans.double().log()
    total = 0.0
    for i in idx.tolist():
        y = sequences[i, : int(lengths[i])].double()
        log_lik = dist.Normal(locs.double(), noise.double()).log_prob(y[:, None, :]).sum(-1)  # (T, S)
        alpha = log_trans[0] + log_lik[0]
        for t in range(1, len(y)):
            alpha = torch.logsumexp(alpha[:, None] + log_trans, 0) + log_lik[t]
        total += torch.logsumexp(alpha, 0).item()
    return log_prior.item() + total * num_sequences / len(idx)


def globals_guide(model, names):
    """AutoDelta on the named global sites, the rest of the model hidden from it."""
    return AutoDelta(poutine.block(model, expose_fn=lambda msg: msg["name"] in names))


# --------------------------------------------------------------------------- #
# LDA: documents plate, words plate inside, topic of each word enumerated
# --------------------------------------------------------------------------- #
LDA_TOPIC_CONC = 0.5
LDA_DOC_CONC = 0.8


@config_enumerate
def lda_model(words, num_topics=3, vocab_size=5):
    """``words``: (words_per_doc, num_docs) long."""
    words_per_doc, num_docs = words.shape
    with pyro.plate("topics", num_topics):
        topic_words = pyro.sample("topic_words", dist.Dirichlet(torch.full((vocab_size,), LDA_TOPIC_CONC)))
    with pyro.plate("documents", num_docs, dim=-1):
        doc_topics = pyro.sample("doc_topics", dist.Dirichlet(torch.full((num_topics,), LDA_DOC_CONC)))
        with pyro.plate("words", words_per_doc, dim=-2):
            topic = pyro.sample("word_topics", dist.Categorical(doc_topics))
            pyro.sample("doc_words", dist.Categorical(topic_words[topic]), obs=words)


def _random_simplex(*shape):
    return torch.distributions.Dirichlet(torch.ones(shape)).sample()


def lda_map_guide(words, num_topics=3, vocab_size=5):
    """Hand-written MAP guide: Delta sites on both Dirichlet globals."""
    words_per_doc, num_docs = words.shape
    topic_words_map = pyro.param(
        "topic_words_map", lambda: _random_simplex(num_topics, vocab_size), constraint=constraints.simplex
    )
    doc_topics_map = pyro.param(
        "doc_topics_map", lambda: _random_simplex(num_docs, num_topics), constraint=constraints.simplex
    )
    with pyro.plate("topics", num_topics):
        pyro.sample("topic_words", dist.Delta(topic_words_map, event_dim=1))
    with pyro.plate("documents", num_docs, dim=-1):
        pyro.sample("doc_topics", dist.Delta(doc_topics_map, event_dim=1))


def lda_dirichlet_guide(words, num_topics=3, vocab_size=5):
    """Topic-word MAP (Delta); each document's topic mix drawn from a Dirichlet guide.

    The guide's concentration starts at 0.7 <= the prior's 0.8, so p(theta)/q(theta) is
    bounded and the importance weights have finite variance.
    """
    words_per_doc, num_docs = words.shape
    topic_words_map = pyro.param(
        "topic_words_map", lambda: _random_simplex(num_topics, vocab_size), constraint=constraints.simplex
    )
    doc_conc = pyro.param(
        "doc_topics_conc", lambda: torch.full((num_docs, num_topics), 0.7), constraint=constraints.positive
    )
    with pyro.plate("topics", num_topics):
        pyro.sample("topic_words", dist.Delta(topic_words_map, event_dim=1))
    with pyro.plate("documents", num_docs, dim=-1):
        pyro.sample("doc_topics", dist.Dirichlet(doc_conc))


def _log_beta(alpha):
    return torch.lgamma(alpha).sum(-1) - torch.lgamma(alpha.sum(-1))


def lda_log_joint(words, topic_words):
    """log p(words, topic_words) with every document's topic mix and every word's topic
    integrated out, by brute force over the num_topics^words_per_doc assignments of a
    document: p(w_d) = sum_z B(alpha + counts(z)) / B(alpha) prod_n phi[z_n, w_nd]."""
    words_per_doc, num_docs = words.shape
    num_topics, vocab_size = topic_words.shape
    phi = topic_words.double()
    log_prior = (
        dist.Dirichlet(torch.full((vocab_size,), LDA_TOPIC_CONC, dtype=torch.float64)).log_prob(phi).sum()
    )
    alpha = torch.full((num_topics,), LDA_DOC_CONC, dtype=torch.float64)
    assignments = torch.tensor(list(itertools.product(range(num_topics), repeat=words_per_doc)))  # (A, n)
    counts = torch.nn.functional.one_hot(assignments, num_topics).sum(1).double()  # (A, T)
    log_dirmult = _log_beta(alpha + counts) - _log_beta(alpha)  # (A,)
    total = log_prior
    for d in range(num_docs):
        log_phi = phi.log()[assignments, words[:, d]].sum(-1)  # (A,)
        total = total + torch.logsumexp(log_dirmult + log_phi, 0)
    return total.item()


# --------------------------------------------------------------------------- #
# A tiny VAE
# --------------------------------------------------------------------------- #
class TinyVAE(nn.Module):
    """Bernoulli decoder and Gaussian encoder, one hidden layer each, latent dim 2."""

    def __init__(self, data_dim=8, latent_dim=2, hidden_dim=16):
        super().__init__()
        self.latent_dim = latent_dim
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim), nn.Softplus(), nn.Linear(hidden_dim, data_dim)
        )
        self.encoder = nn.Sequential(
            nn.Linear(data_dim, hidden_dim), nn.Softplus(), nn.Linear(hidden_dim, 2 * latent_dim)
        )

    def model(self, x):
        pyro.module("decoder", self.decoder)
        with pyro.plate("batch", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([self.latent_dim]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=self.decoder(z)).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("encoder", self.encoder)
        loc, raw_scale = self.encoder(x).split(self.latent_dim, -1)
        with pyro.plate("batch", x.shape[0]):
            pyro.sample("z", dist.Normal(loc, nn.functional.softplus(raw_scale) + 1e-3).to_event(1))


# --------------------------------------------------------------------------- #
# Gaussian mixtures
# --------------------------------------------------------------------------- #
@config_enumerate
def gmm_model(data, num_components=3):
    """Mixture of Normals with a shared scale; weights, locations, scale all global."""
    weights = pyro.sample("weights", dist.Dirichlet(torch.full((num_components,), 0.5)))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("components", num_components):
        locs = pyro.sample("locs", dist.Normal(0.0, 5.0))
    with pyro.plate("data", len(data)):
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[assignment], scale), obs=data)


GMM_PRIOR_SCALE = 2.0
GMM_NOISE = 0.8
GMM_WEIGHTS_CONC = torch.tensor([2.0, 2.0])


def gmm_sampled_locs_model(data):
    """Two components: weights ~ Dirichlet (MAP), locs ~ N(0, 2^2) iid as one vector site
    (sampled), noise fixed, assignments enumerated; locations read with ``Vindex``."""
    weights = pyro.sample("weights", dist.Dirichlet(GMM_WEIGHTS_CONC))
    locs = pyro.sample("locs", dist.Normal(0.0, GMM_PRIOR_SCALE).expand([2]).to_event(1))
    with pyro.plate("data", len(data)):
        assignment = pyro.sample("assignment", dist.Categorical(weights), infer={"enumerate": "parallel"})
        pyro.sample("obs", dist.Normal(Vindex(locs)[..., assignment], GMM_NOISE), obs=data)


def gmm_sampled_locs_log_joint(data, weights):
    """log p(data, weights): sum over the 2^n assignments c of
    prod_i w[c_i] N(data; 0, s0^2 [c_i == c_j] + noise^2 I), times the Dirichlet prior."""
    n = len(data)
    w = weights.double()
    terms = []
    for c in itertools.product(range(2), repeat=n):
        c = torch.tensor(c)
        same = (c[:, None] == c[None, :]).double()
        cov = GMM_PRIOR_SCALE**2 * same + GMM_NOISE**2 * torch.eye(n, dtype=torch.float64)
        terms.append(w.log()[c].sum().item() + _normal_logpdf(data, 0.0, cov))
    log_prior = dist.Dirichlet(GMM_WEIGHTS_CONC.double()).log_prob(w).item()
    return log_prior + torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0).item()
