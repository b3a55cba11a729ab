"""Tests of pyro_tmc.ops: log-space einsum, underflow repair, contraction, memory budget."""
