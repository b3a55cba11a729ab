"""Tensor maths with no model in it, one job a module.

- shapes: :mod:`~pyro_tmc.ops.shapes`; log densities of many sites: :mod:`~pyro_tmc.ops.log_density`;
- log space: the einsum backend (:mod:`~pyro_tmc.ops.log_einsum`), the sums that never underflow
  and the eager repair (:mod:`~pyro_tmc.ops.underflow`), matrix products
  (:mod:`~pyro_tmc.ops.log_matmul`) and their repair inside a traced graph
  (:mod:`~pyro_tmc.ops.graph_repair`), chains of matrices (:mod:`~pyro_tmc.ops.chains`);
- the contraction of packed log factors (:mod:`~pyro_tmc.ops.contraction`): Pyro's ring with
  subsampled plates (:mod:`~pyro_tmc.ops.ring`), factors summed out slice by slice
  (:mod:`~pyro_tmc.ops.chunked`), chains among the factors (:mod:`~pyro_tmc.ops.chain_factors`);
- bytes and memory (:mod:`~pyro_tmc.ops.memory`);
- what a capture asks of all these (:mod:`~pyro_tmc.ops.capture`).

The lowest layer but :mod:`pyro_tmc._pyro`: it imports nothing else of the package.
"""
