"""Poutine handlers of pyro_tmc."""

from pyro_tmc.poutine.particle_group import ParticleGroupMessenger, particle_group
from pyro_tmc.poutine.tmc_messenger import TMCMessenger, tmc

__all__ = ["ParticleGroupMessenger", "TMCMessenger", "particle_group", "tmc"]
