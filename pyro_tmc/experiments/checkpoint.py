"""
Checkpoints for runs that resume: everything a training loop needs to continue exactly where it
stopped, written at the end of each epoch.

A checkpoint is a dict in the manner of PyTorch Lightning's (``epoch``, ``global_step``,
``hyper_parameters``, state dicts), saved with :func:`torch.save`:

- ``param_store``: :meth:`pyro.params.param_store.ParamStoreDict.get_state`. Modules registered with
  :func:`pyro.module` live there too; on loading they are bound back to their
  :class:`~torch.nn.Module` (``pyro.module(..., update_module_params=True)``, Pyro's documented way
  to load modules from the param store);
- ``optimizer``: :meth:`pyro.optim.PyroOptim.get_state` (Adam's moments and step counts);
- ``rng_states``: torch's, Python's and NumPy's global generators (:func:`pyro.util.get_rng_state`),
  CUDA's when CUDA is available, and any named :class:`torch.Generator` (a data loader's shuffling);
- whatever else the loop passes: its counters, its loss history, the rows it has written.

With all of it restored, the resumed run draws the same minibatches and particles as an
uninterrupted one, so its parameters and losses are the same. The file is written atomically (a
temporary file, then :func:`os.replace`): a run killed while saving leaves the previous checkpoint.
"""

import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

import pyro
import pyro.util
from pyro.optim import PyroOptim


def rng_states(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    """The global generators' states (CUDA's when available) and those of ``generators``, by name."""
    states = pyro.util.get_rng_state()
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    states["generators"] = {name: generator.get_state() for name, generator in generators.items()}
    return states


def set_rng_states(states: dict[str, Any], generators: Mapping[str, torch.Generator]) -> None:
    """Restore what :func:`rng_states` returned (has side effects: every global generator)."""
    pyro.util.set_rng_state(states)
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    for name, generator in generators.items():
        generator.set_state(states["generators"][name])


def atomic_save(obj: Any, path: str) -> None:
    """:func:`torch.save` to a temporary file beside ``path``, flushed to disk, then renamed over it."""
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


class CheckpointError(ValueError):
    """A checkpoint that can't be resumed: saved under other settings, or past the run's end."""


class Checkpoint:
    """
    The checkpoint file of one training run, and the state it saves and restores.

    :param str path: the file (its folder is created on the first save).
    :param optim: the run's optimiser.
    :param dict modules: ``{name: module}`` for each module registered with ``pyro.module(name, ...)``.
    :param dict hyper_parameters: the settings the run's state depends on (data size, K, seed...); a
        checkpoint saved under other settings is refused, as continuing it would mix two runs.
    :param dict generators: ``{name: generator}``: torch generators the loop draws from besides the
        global ones (e.g. a :class:`~torch.utils.data.DataLoader`'s).
    """

    def __init__(
        self,
        path: str,
        optim: PyroOptim,
        modules: Optional[Mapping[str, torch.nn.Module]] = None,
        hyper_parameters: Optional[dict[str, Any]] = None,
        generators: Optional[Mapping[str, torch.Generator]] = None,
    ) -> None:
        self.path = path
        self.optim = optim
        self.modules = dict(modules or {})
        self.hyper_parameters = dict(hyper_parameters or {})
        self.generators = dict(generators or {})

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def save(self, epoch: int, global_step: int, **progress: Any) -> None:
        """
        Save the state at the end of an epoch.

        :param int epoch: the number of epochs completed.
        :param int global_step: the number of optimiser steps taken.
        :param progress: what else the loop needs to continue (loss history, rows written so far).
        """
        state = {
            "epoch": epoch,
            "global_step": global_step,
            "hyper_parameters": self.hyper_parameters,
            "param_store": pyro.get_param_store().get_state(),
            "optimizer": self.optim.get_state(),
            "rng_states": rng_states(self.generators),
            **progress,
        }
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        atomic_save(state, self.path)

    def read(self, map_location=None) -> dict[str, Any]:
        """
        The saved dict, unapplied.

        :raises CheckpointError: when it was saved under other hyper-parameters.
        """
        state = torch.load(self.path, map_location=map_location, weights_only=False)  # our own file
        saved = state["hyper_parameters"]
        differ = sorted(
            k for k in set(saved) | set(self.hyper_parameters) if saved.get(k) != self.hyper_parameters.get(k)
        )
        if differ:
            changes = ", ".join(
                f"{k}: {saved.get(k)!r} then, {self.hyper_parameters.get(k)!r} now" for k in differ
            )
            raise CheckpointError(
                f"The checkpoint {self.path} belongs to a run with other settings ({changes}): "
                "resume with the same settings, or start afresh (--overwrite, or another --out)."
            )
        return state

    def load(self, map_location=None) -> dict[str, Any]:
        """
        Restore the saved state: the param store (the modules bound to it), the optimiser, the
        random generators. Has side effects on all of them; call it after the modules and the
        optimiser are built and before the first step.

        :returns: the saved dict (``epoch``, ``global_step`` and the loop's own entries).
        """
        state = self.read(map_location)
        pyro.clear_param_store()
        pyro.get_param_store().set_state(state["param_store"])
        for name, module in self.modules.items():
            pyro.module(name, module, update_module_params=True)
        self.optim.set_state(state["optimizer"])
        set_rng_states(state["rng_states"], self.generators)
        return state

    def resume(self, epochs: int, map_location=None) -> dict[str, Any]:
        """
        :meth:`load` the checkpoint if there is one, for a run of ``epochs`` epochs in all.

        :returns: the saved dict, or ``{}`` when there is no checkpoint (the run starts afresh).
        :raises CheckpointError: when the checkpoint is of other settings, or already past ``epochs``.
        """
        if not self.exists():
            return {}
        saved = self.load(map_location)
        if saved["epoch"] > epochs:
            raise CheckpointError(
                f"The checkpoint {self.path} has {saved['epoch']} epochs, more than the {epochs} asked "
                "for: resume with --epochs at least that, or start afresh (--overwrite, or another --out)."
            )
        return saved
