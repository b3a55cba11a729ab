"""The enumerated HMM of ``first_step.py`` in plain torch: four forms of its loop under torch.compile.

    python benchmarks/hmm_scan_forms.py --length 200 --form tree     # tree, associative_scan, scan, loop

The floor for a captured ``pyro.markov`` loop compiled by inductor: the exact ``-log p(y)`` and its
gradient with no Pyro, no repair of underflow and no rolling, compiled by ``torch.compile`` (cold
inductor cache, in this process; the first call includes torch.compile's one-time start-up):

- ``tree``: the ``(T-1, 16, 4, 4)`` stacked links multiplied in a log-depth tree of
  log-sum-exp products, as pyro_tmc contracts a chain;
- ``associative_scan``: torch's higher-order op (``combine_mode="generic"``) over the links;
- ``scan``: torch's ``scan`` higher-order op over the forward messages (one traced body);
- ``loop``: the forward algorithm as a Python loop, unrolled by the trace.

Each run prints its first call, its median step and its loss against the float64 forward
algorithm's (16673.627 at T=200, 83009.370 at T=1000).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch.distributions import Normal

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "numpyro_hmm")
NUM_STATES = 4


def emission_log_probs(locs: torch.Tensor, observations: torch.Tensor) -> torch.Tensor:
    """``(T, sequences, states)``: each observation's log density under each state's mean."""
    return Normal(locs, 1.0).log_prob(observations[:, :, None, :]).sum(-1)


def log_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``log(exp(a) @ exp(b))`` by log-sum-exp (exact, no shift: the matrices are 4 x 4)."""
    return torch.logsumexp(a[..., :, :, None] + b[..., None, :, :], -2)


def links(logits: torch.Tensor, locs: torch.Tensor, observations: torch.Tensor):
    """The first step's log weights ``(sequences, states)``; the later links ``(T-1, sequences, 4, 4)``."""
    log_transition = torch.log_softmax(logits, -1)
    emissions = emission_log_probs(locs, observations)
    first = emissions[0] - torch.log(torch.tensor(float(NUM_STATES)))
    return first, log_transition + emissions[1:, :, None, :]


def loss_tree(logits, locs, observations):
    first, chain = links(logits, locs, observations)
    while chain.shape[0] > 1:
        n = chain.shape[0]
        paired = log_product(chain[0 : n - 1 : 2], chain[1:n:2])
        chain = torch.cat([paired, chain[n - 1 :]], 0) if n % 2 else paired
    return -torch.logsumexp(first[:, :, None] + chain[0], (-2, -1)).sum()


def loss_associative_scan(logits, locs, observations):
    from torch._higher_order_ops.associative_scan import associative_scan

    first, chain = links(logits, locs, observations)
    products = associative_scan(log_product, chain, 0, combine_mode="generic")
    return -torch.logsumexp(first[:, :, None] + products[-1], (-2, -1)).sum()


def loss_scan(logits, locs, observations):
    from torch._higher_order_ops.scan import scan

    first, chain = links(logits, locs, observations)

    def forward_message(alpha, link):
        alpha = torch.logsumexp(alpha[:, :, None] + link, 1)
        return alpha, alpha.clone()

    alpha, _ = scan(forward_message, first, chain)
    return -torch.logsumexp(alpha, -1).sum()


def loss_loop(logits, locs, observations):
    first, chain = links(logits, locs, observations)
    alpha = first
    for t in range(chain.shape[0]):
        alpha = torch.logsumexp(alpha[:, :, None] + chain[t], 1)
    return -torch.logsumexp(alpha, -1).sum()


FORMS = {"tree": loss_tree, "associative_scan": loss_associative_scan, "scan": loss_scan, "loop": loss_loop}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=200, choices=(200, 1000))
    parser.add_argument("--form", default="tree", choices=tuple(FORMS))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="hmm_scan_forms_"))
    torch.set_num_threads(1)
    observations = torch.from_numpy(np.load(os.path.join(DATA, f"obs_T{args.length}.npy")))
    locs = torch.from_numpy(np.load(os.path.join(DATA, "locs.npy"))).clone().requires_grad_()
    logits = torch.zeros(NUM_STATES, NUM_STATES, requires_grad=True)
    with torch.no_grad():
        exact = loss_loop(logits.double(), locs.double(), observations.double()).item()
    compiled = torch.compile(FORMS[args.form], dynamic=False)

    def step() -> torch.Tensor:
        logits.grad = locs.grad = None
        value = compiled(logits, locs, observations)
        value.backward()
        return value

    start = time.perf_counter()
    try:
        value = step()
    except Exception as error:  # report and stop: the form does not compile here
        print(
            f"{args.form} T={args.length}: failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        )
        sys.exit(1)
    first_call = time.perf_counter() - start
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    print(
        f"{args.form} T={args.length}: first call {first_call:.1f} s, "
        f"{1e3 * statistics.median(seconds):.2f} ms a step; loss {value.item():.3f} "
        f"(float64 forward algorithm {exact:.3f})"
    )


if __name__ == "__main__":
    main()
