"""Tests of pyro_tmc.experiments: the paper's experiments, end to end."""
