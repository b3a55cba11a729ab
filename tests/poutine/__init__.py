"""Tests of pyro_tmc.poutine: the handler, particle groups, sites, chain dims."""
