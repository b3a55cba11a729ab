"""Poutine handlers of pyro_tmc."""

from .tmc_messenger import TMCMessenger, tmc

__all__ = ["TMCMessenger", "tmc"]
