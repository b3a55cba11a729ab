"""Tensor maths with no model in it: shapes, the log-space einsum backend and its underflow repair,
the contraction of packed log factors (ring, chunked elimination, chains) and the memory budget.

The lowest layer: it imports nothing else of the package (:mod:`pyro_tmc.poutine.sites` aside,
for the budget's error messages, which name sites).
"""
