"""Tests of pyro_tmc.contrib: data-parallel training."""
