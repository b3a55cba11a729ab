"""Poutine handlers of pyro_tmc."""

from .particle_group import ParticleGroupMessenger, particle_group
from .tmc_messenger import TMCMessenger, tmc

__all__ = ["ParticleGroupMessenger", "TMCMessenger", "particle_group", "tmc"]
