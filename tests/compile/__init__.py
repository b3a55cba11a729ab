"""Tests of pyro_tmc.compile: captured and compiled steps equal the eager ones."""
