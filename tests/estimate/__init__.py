"""Tests of pyro_tmc.estimate: one draw to named log factors."""
