"""Tests of pyro_tmc.infer: the losses and read-outs, against independent oracles."""
