"""CompileConfig: every setting of the capture engine in one object, given as ``compile_options``."""

import pickle

import pytest
import torch

import pyro

from pyro_tmc import TMC_ELBO
from pyro_tmc.compile import CompileConfig
from tests.common.compile_cases import toy_guide, toy_model


def test_a_dict_is_torch_compiles_keywords():
    loss = TMC_ELBO(compile="inductor", compile_options={"mode": "reduce-overhead"})
    assert loss.compile_config == CompileConfig(torch_compile={"mode": "reduce-overhead"})
    assert TMC_ELBO(compile="graph").compile_config == CompileConfig()
    assert TMC_ELBO().compile_config is None  # eager: no engine, no settings


def test_a_loss_keeps_its_own_copy():
    """Two losses given one config never share it: changing one loss's settings leaves the other's."""
    config = CompileConfig(roll_above=None, torch_compile={"options": {"cpp_wrapper": False}})
    first, second = (TMC_ELBO(compile="inductor", compile_options=config) for _ in range(2))
    first.compile_config.roll_above = 7
    first.compile_config.torch_compile["options"] = {}
    first.compile_config.inductor_settings["x"] = 1
    assert second.compile_config == config and config.roll_above is None
    assert "x" not in CompileConfig().inductor_settings


def test_the_step_programs_settings_are_the_configs():
    """``loss.step_program.<setting>``, as the docs once told users to set it, is the config's field."""
    loss = TMC_ELBO(compile="graph", compile_options=CompileConfig(max_inductor_nodes=5))
    assert loss.step_program.max_inductor_nodes == 5
    for name, value in [("roll_above", None), ("batch_draws", True), ("choose_faster", False)]:
        setattr(loss.step_program, name, value)
        assert getattr(loss.compile_config, name) is value
    loss.step_program.compile_in_background = True
    assert loss.compile_config.compile_in_background
    copy = pickle.loads(pickle.dumps(loss))  # a loss sent to worker processes keeps its settings
    assert copy.step_program.config == copy.compile_config == loss.compile_config


def test_check_every_given_to_the_loss_wins():
    config = CompileConfig(check_every=5)
    assert TMC_ELBO(compile="graph", compile_options=config).step_program.check_every == 5
    assert TMC_ELBO(compile="graph", compile_options=config, check_every=3).step_program.check_every == 3
    assert TMC_ELBO(compile="graph").step_program.check_every == 100


def test_bad_settings_are_refused():
    with pytest.raises(TypeError, match="compile_options"):
        TMC_ELBO(compile="graph", compile_options=["mode"])
    with pytest.raises(TypeError, match="torch_compile"):
        CompileConfig(torch_compile="reduce-overhead")
    with pytest.raises(ValueError, match="check_every"):
        CompileConfig(check_every=0)
    with pytest.raises(ValueError, match="need compile='inductor'"):
        TMC_ELBO(compile="graph", compile_options=CompileConfig(torch_compile={"mode": "default"}))


def test_a_setting_changes_what_the_engine_does():
    """``max_captures=1``: a second argument shape runs eagerly, where the default captures it."""

    def captures(config):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        loss = TMC_ELBO(num_samples=4, max_plate_nesting=1, compile="graph", compile_options=config)
        loss.step_program.choose_faster = False
        for size in (3, 4):
            for _ in range(2):  # eager, then captured
                loss.loss_and_grads(toy_model, toy_guide, torch.randn(size))
        return loss.step_program.captures

    assert captures(CompileConfig()) == 2
    assert captures(CompileConfig(max_captures=1)) == 1
