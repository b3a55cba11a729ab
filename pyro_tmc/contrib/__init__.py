"""Integrations with other libraries: data-parallel training with PyTorch Lightning
(:mod:`~pyro_tmc.contrib.lightning`, the ``[distributed]`` extra; also importable as
``pyro_tmc.distributed``)."""
