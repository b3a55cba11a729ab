"""One draw's traces -> named log factors and their estimate: the factors of each site, their
scales, stacked densities, vectorized_markov chains, the checks that name a site, and the plan
of how an estimate is evaluated. Below :mod:`pyro_tmc.infer`, above :mod:`pyro_tmc.ops`.
"""
