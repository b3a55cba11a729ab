"""TMC_ELBO(compile=...): the traced (and inductor-compiled) estimate equals the eager one.

Every comparison runs the same loss twice from the same seed, once eager and once
through the program: a program consumes no random numbers, so both see the same
draw, and their values and gradients must agree to float precision.
"""

import math
import warnings

import pytest
import torch

import pyro
import pyro.distributions as dist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoIAFNormal, AutoNormal

from pyro_tmc import IWAE_ELBO, TMC_ELBO, TMC_RWS
from tests.common.compile_cases import DoubleGrad, cases, toy_guide, toy_model

CASES = list(cases())


def _loss_and_grads(loss, model, guide, args, seed):
    pyro.set_rng_seed(seed)
    value = loss.differentiable_loss(model, guide, *args)
    params = [p for p in pyro.get_param_store()._params.values() if p.requires_grad]
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return value.detach(), {p: g for p, g in zip(params, grads)}


def _assert_same(eager, program, rtol=1e-5):
    value_eager, grads_eager = eager
    value_program, grads_program = program
    scale = max(1.0, abs(value_eager.item()))
    assert abs(value_program.item() - value_eager.item()) <= rtol * scale
    assert grads_eager.keys() == grads_program.keys()
    for param, grad in grads_eager.items():
        other = grads_program[param]
        assert (grad is None) == (other is None)
        if grad is not None:
            assert torch.allclose(other, grad, rtol=rtol, atol=rtol * max(1.0, grad.abs().max().item()))


def _run_both(case, mode="graph", make_loss=TMC_ELBO, **loss_kwargs):
    pyro.clear_param_store()
    model, guide, args, nesting = cases()[case]
    eager_loss = make_loss(num_samples=4, max_plate_nesting=nesting, **loss_kwargs)
    program_loss = make_loss(num_samples=4, max_plate_nesting=nesting, compile=mode, **loss_kwargs)
    _loss_and_grads(eager_loss, model, guide, args, 0)  # create the params
    results, traces = [], []
    for seed in (1, 2):  # the second draw reuses the first draw's graphs
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback
            program = _loss_and_grads(program_loss, model, guide, args, seed)
        traces.append(program_loss.program.traces)
        results.append((_loss_and_grads(eager_loss, model, guide, args, seed), program))
    assert traces[0] >= 1 and traces[1] == traces[0]  # nothing traced again
    return program_loss, results


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variance_reduction", [None, "stl", "dregs"])
def test_graph_equals_eager(case, variance_reduction):
    if variance_reduction is not None and case == "hmm_autodelta":
        pytest.skip("no reparameterised guide latent")
    if variance_reduction == "dregs" and case == "non_factorised":
        pytest.skip("DReGs takes factorised guides")
    loss, results = _run_both(case, variance_reduction=variance_reduction)
    for eager, program in results:
        _assert_same(eager, program)
    # STL and DReGs take two estimates per step (on leaves, and the plain bound): two graphs
    assert loss.program.traces == (1 if variance_reduction is None else 2)


@pytest.mark.parametrize("make_loss", [IWAE_ELBO, TMC_RWS], ids=["iwae", "rws"])
def test_graph_equals_eager_other_losses(make_loss):
    loss, results = _run_both("toy", make_loss=make_loss)
    for eager, program in results:
        _assert_same(eager, program)


@pytest.mark.parametrize("case", ["toy", "chain_log_depth", "autonormal"])
def test_inductor_equals_eager(case):
    """AutoNormal: its parameters enter the graph as they are, and TorchDynamo marks them (not a new plan)."""
    torch._dynamo.reset()
    _, results = _run_both(case, mode="inductor")
    for eager, program in results:
        _assert_same(eager, program, rtol=1e-5)


def test_traced_again_only_when_shapes_change():
    pyro.clear_param_store()
    loss = TMC_ELBO(num_samples=4, max_plate_nesting=1, compile="graph")
    for seed in range(3):
        pyro.set_rng_seed(seed)
        loss.differentiable_loss(toy_model, toy_guide, torch.randn(6)).backward()
    assert loss.program.traces == 1
    loss.differentiable_loss(toy_model, toy_guide, torch.randn(7)).backward()
    assert loss.program.traces == 2
    loss.differentiable_loss(toy_model, toy_guide, torch.randn(6)).backward()
    assert loss.program.traces == 2  # the first graph again, from the cache


def test_svi_trains_with_program():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.randn(6) + 2.0
    svi = SVI(toy_model, toy_guide, pyro.optim.Adam({"lr": 0.05}), TMC_ELBO(4, 1, compile="graph"))
    losses = [svi.step(x) for _ in range(150)]
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20


class ClosureNormal(dist.Normal):
    """A distribution whose log density reads a tensor the trace does not hold."""

    hidden_shift = torch.tensor(0.25)

    def log_prob(self, value):
        return super().log_prob(value) + type(self).hidden_shift


def closure_model(x):
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        pyro.sample("x", ClosureNormal(theta, 1.0), obs=x)


def _fallbacks_beside_eager(model, guide, x, nesting: int, method: str, seeds: int) -> list:
    """
    ``method`` (``"loss"`` or ``"differentiable_loss"``) under ``compile="graph"`` and
    eagerly, from the same seeds: equal values; the fallback warnings given.
    """
    eager, program = TMC_ELBO(4, nesting), TMC_ELBO(4, nesting, compile="graph")
    eager.loss(model, guide, x)  # the guide's params and modules are built on first use
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(seeds):
            pyro.set_rng_seed(seed)
            value = float(getattr(program, method)(model, guide, x))
            pyro.set_rng_seed(seed)
            assert value == pytest.approx(float(getattr(eager, method)(model, guide, x)))
    return [str(w.message) for w in caught if "could not trace" in str(w.message)]


def test_untraceable_estimate_falls_back_with_one_warning():
    pyro.clear_param_store()
    x = torch.randn(5)
    fallbacks = _fallbacks_beside_eager(
        closure_model, AutoNormal(closure_model), x, 1, "differentiable_loss", 3
    )
    assert len(fallbacks) == 1
    assert "reads a tensor that is not one of the draw's" in fallbacks[0]  # in user terms


def iaf_model(x):
    z = pyro.sample("z", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x)


def test_an_untraceable_estimate_names_the_module_that_holds_the_tensor():
    """
    A normalizing flow's transform refers to an nn.Module (AutoIAFNormal's network),
    which the estimate program keeps as it is: its tensors are not inputs, so the
    estimate runs eagerly, and the warning names the module and the site.
    """
    pyro.clear_param_store()
    x = torch.randn(3)
    fallbacks = _fallbacks_beside_eager(iaf_model, AutoIAFNormal(iaf_model), x, 0, "loss", 2)
    # (each step builds new transforms, so each is a new plan, traced and failing again)
    assert fallbacks and all("AutoRegressiveNN at site '_AutoIAFNormal_latent'" in f for f in fallbacks)


def test_nan_is_named_under_program():
    pyro.clear_param_store()
    x = torch.randn(6)
    x[2] = math.nan
    with pytest.raises(ValueError, match="observed value of site 'x' contains NaN"):
        TMC_ELBO(4, 1, compile="graph").differentiable_loss(toy_model, toy_guide, x)


def test_support_is_checked_under_program():
    def model(x):
        rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("x", dist.Poisson(rate), obs=x)

    pyro.clear_param_store()
    x = torch.tensor([1.0, -2.0, 3.0])  # -2 is outside a Poisson's support
    with pyro.validation_enabled(True), pytest.raises(ValueError, match="site 'x'"):
        TMC_ELBO(4, 1, compile="graph").differentiable_loss(model, AutoNormal(model), x)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="compile must be one of"):
        TMC_ELBO(4, 1, compile="fast")
    with pytest.raises(ValueError, match="need compile='inductor'"):
        TMC_ELBO(4, 1, compile="graph", compile_options={"mode": "reduce-overhead"})


def test_compile_keywords_carry_the_settings_and_the_mode():
    """
    torch.compile takes a mode or options, not both: a mode goes in as its settings,
    beside pyro_tmc's own, which a user's options override. Another backend gets the
    user's keywords untouched.
    """
    from pyro_tmc.compile import CompileConfig
    from pyro_tmc.compile.compiled import compile_keywords, inductor_settings, uses_cuda_graphs

    def keywords(torch_compile):
        return compile_keywords(CompileConfig(torch_compile))

    assert CompileConfig().inductor_settings.items() <= inductor_settings().items()
    assert keywords({}) == {"dynamic": False, "options": inductor_settings()}
    reduce_overhead = keywords({"mode": "reduce-overhead"})
    assert "mode" not in reduce_overhead
    assert reduce_overhead["options"] == {**inductor_settings(), "triton.cudagraphs": True}
    assert uses_cuda_graphs(CompileConfig({"mode": "max-autotune"})) and not uses_cuda_graphs(CompileConfig())
    assert uses_cuda_graphs(CompileConfig({"options": {"triton.cudagraphs": True}}))
    setting = next(iter(CompileConfig().inductor_settings))
    assert keywords({"options": {setting: 64}})["options"][setting] == 64
    assert keywords({"backend": "aot_eager", "mode": "default"}) == {
        "dynamic": False,
        "backend": "aot_eager",
        "mode": "default",
    }
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        keywords({"mode": "fastest"})


def test_a_compiled_step_graph_is_kept_in_inductors_graph_cache(monkeypatch, tmp_path):
    """
    A captured step's graph, compiled again (a later process, the same model), comes
    from inductor's FX graph cache instead of a new compile: ``torch._inductor.compile``
    alone has no shape environment, and the cache bypassed every such graph, so a
    second process compiled Fig. 4's 100-link chain afresh (20-28 s against 3 s).
    """
    from torch._dynamo.utils import counters
    from torch.fx.experimental.proxy_tensor import make_fx

    from pyro_tmc.compile import CompileConfig
    from pyro_tmc.compile.compiled import compiled_step_graph

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, 3)
    graph = make_fx(lambda t: ((t.sin() * 2.0).sum(0),))(x)
    counters["inductor"].clear()
    with torch.no_grad():
        values = [compiled_step_graph(graph, CompileConfig())(x)[0] for _ in range(2)]  # two compiles
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 1
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    for value in values:
        assert torch.allclose(value, (x.sin() * 2.0).sum(0))


@pytest.mark.parametrize("variance_reduction", ["stl", "dregs"])
def test_inductor_estimate_takes_the_inner_gradient(variance_reduction):
    """
    STL and DReGs differentiate the estimate inside the step (``retain_graph=True``).
    A compiled backward with donated buffers refuses that: such a step raised under
    ``compile="inductor"`` wherever it used the estimate program.
    """
    torch._dynamo.reset()
    pyro.clear_param_store()
    x = torch.randn(5)
    eager = TMC_ELBO(4, 1, variance_reduction=variance_reduction)
    program = TMC_ELBO(
        4, 1, variance_reduction=variance_reduction, compile="inductor", compile_scope="estimate"
    )
    _loss_and_grads(eager, toy_model, toy_guide, (x,), 0)
    for seed in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback to eager
            result = _loss_and_grads(program, toy_model, toy_guide, (x,), seed)
        _assert_same(_loss_and_grads(eager, toy_model, toy_guide, (x,), seed), result)
    assert program.program.traces >= 1  # the estimate ran compiled


def test_inductor_leaves_validation_as_it_was():
    """torch.compile switches distribution validation off process-wide on first use; it is restored."""
    torch._dynamo.reset()
    pyro.clear_param_store()
    with pyro.validation_enabled(True):
        TMC_ELBO(4, 1, compile="inductor").differentiable_loss(toy_model, toy_guide, torch.randn(5))
        assert dist.Normal(0.0, 1.0)._validate_args


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["graph", "inductor", "reduce-overhead"])
def test_program_equals_eager_cuda(mode):
    torch._dynamo.reset()
    pyro.clear_param_store()
    x = torch.randn(64, device="cuda")
    eager = TMC_ELBO(16, 1)
    if mode == "reduce-overhead":  # inductor with CUDA graphs
        program = TMC_ELBO(16, 1, compile="inductor", compile_options={"mode": mode})
    else:
        program = TMC_ELBO(16, 1, compile=mode)
    _loss_and_grads(eager, toy_model, toy_guide, (x,), 0)
    for seed in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result = _loss_and_grads(program, toy_model, toy_guide, (x,), seed)
        _assert_same(_loss_and_grads(eager, toy_model, toy_guide, (x,), seed), result)
    assert program.program.traces == 1


def test_all_underflow_slice_keeps_a_zero_gradient():
    """An observation impossible under some particles: its slices are -inf; gradients stay finite."""

    def model(x):
        theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("data", x.shape[-1], dim=-1):
            z = pyro.sample("z", dist.Normal(theta, 1.0))
            # support [z - 2, z + 2]: some particles give the datum zero density
            pyro.sample("x", dist.Uniform(z - 2.0, z + 2.0, validate_args=False), obs=x)

    pyro.clear_param_store()
    x = torch.tensor([0.1, 1.5, -0.4])
    eager, program = TMC_ELBO(6, 1), TMC_ELBO(6, 1, compile="graph")
    _loss_and_grads(eager, model, toy_guide, (x,), 0)
    found_infinite_slice = False
    for seed in range(1, 6):
        pyro.set_rng_seed(seed)
        draw = eager.draw(model, toy_guide, x)
        found_infinite_slice |= bool(torch.isinf(draw.model_trace.nodes["x"]["fn"].log_prob(x)).any())
        expected = _loss_and_grads(eager, model, toy_guide, (x,), seed)
        if not math.isfinite(expected[0].item()):
            continue  # every combination impossible: the eager error path, tested elsewhere
        result = _loss_and_grads(program, model, toy_guide, (x,), seed)
        assert all(torch.isfinite(g).all() for g in result[1].values() if g is not None)
        _assert_same(expected, result)
    assert found_infinite_slice


class CustomBackwardNormal(dist.Normal):
    def log_prob(self, value):
        return DoubleGrad.apply(super().log_prob(value))


def test_custom_autograd_function_falls_back():
    def model(x):
        theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("x", CustomBackwardNormal(theta, 1.0), obs=x)

    pyro.clear_param_store()
    x = torch.randn(4)
    guide = AutoNormal(model)
    eager, program = TMC_ELBO(4, 1), TMC_ELBO(4, 1, compile="graph")
    _loss_and_grads(eager, model, guide, (x,), 0)
    with pytest.warns(RuntimeWarning, match="custom autograd.Function DoubleGrad"):
        result = _loss_and_grads(program, model, guide, (x,), 1)
    _assert_same(_loss_and_grads(eager, model, guide, (x,), 1), result)


def transformed_model(x, temperature):
    """A Python float inside a transform: part of the plan, not a constant frozen at its first value."""
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", x.shape[-1], dim=-1):
        base = dist.Normal(theta, 1.0)
        scaled = dist.TransformedDistribution(base, [dist.transforms.AffineTransform(0.0, temperature)])
        pyro.sample("x", scaled, obs=x)


def test_transform_parameters_are_part_of_the_plan():
    pyro.clear_param_store()
    x = torch.randn(5)
    guide = AutoNormal(transformed_model)
    eager, program = TMC_ELBO(4, 1), TMC_ELBO(4, 1, compile="graph")
    _loss_and_grads(eager, transformed_model, guide, (x, 1.0), 0)
    for seed, temperature in enumerate([1.0, 2.0, 1.0, 0.5]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result = _loss_and_grads(program, transformed_model, guide, (x, temperature), seed)
        _assert_same(_loss_and_grads(eager, transformed_model, guide, (x, temperature), seed), result)
    assert program.program.traces == 3  # one plan per temperature


def test_too_many_plans_run_eagerly_with_one_warning():
    from pyro_tmc.compile import CompileConfig

    pyro.clear_param_store()
    eager = TMC_ELBO(4, 1)
    program = TMC_ELBO(4, 1, compile="graph", compile_options=CompileConfig(max_plans=2))
    _loss_and_grads(eager, toy_model, toy_guide, (torch.randn(3),), 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed, size in enumerate([3, 4, 5, 6, 7]):
            x = torch.randn(size)
            result = _loss_and_grads(program, toy_model, toy_guide, (x,), seed)
            _assert_same(_loss_and_grads(eager, toy_model, toy_guide, (x,), seed), result)
    assert program.program.traces == 2
    assert len([w for w in caught if "different plans" in str(w.message)]) == 1


def test_posterior_read_outs_equal_eager():
    """compute_marginals reads the draw through sources: the graph takes them as inputs."""
    pyro.clear_param_store()
    x = torch.randn(6)
    eager, program = TMC_ELBO(5, 1), TMC_ELBO(5, 1, compile="graph")
    _loss_and_grads(eager, toy_model, toy_guide, (x,), 0)
    for seed in (1, 2):
        pyro.set_rng_seed(seed)
        expected = eager.compute_marginals(toy_model, toy_guide, x)
        pyro.set_rng_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result = program.compute_marginals(toy_model, toy_guide, x)
        for name in ("theta", "z"):
            assert torch.allclose(result[name].mean, expected[name].mean, rtol=1e-5, atol=1e-6)
            assert torch.allclose(result[name].variance, expected[name].variance, rtol=1e-5, atol=1e-6)
    assert program.program.traces == 1


@pytest.mark.parametrize("mode", ["graph", "inductor"])
def test_loss_with_a_program_pickles(mode):
    """A loss sent to worker processes (data-parallel training) pickles; the copy traces its own graphs."""
    import pickle

    torch._dynamo.reset()
    pyro.clear_param_store()
    x = torch.randn(5)
    loss = TMC_ELBO(4, 1, compile=mode)
    loss.differentiable_loss(toy_model, toy_guide, x).backward()
    copy = pickle.loads(pickle.dumps(loss))
    assert copy.program.traces == loss.program.traces == 1
    copy.differentiable_loss(toy_model, toy_guide, x).backward()
    assert copy.program.traces == 2  # its own trace; the original's cache is untouched


def inverse_transform_guide(x):
    """A proposal through inverse transforms (``t.inv``), as normalizing flows and
    ``AutoRegressiveMessenger`` build them: an inverse transform holds the transform it inverts."""
    loc = pyro.param("loc", torch.tensor(0.3))
    scale = pyro.param("scale", torch.tensor(1.5), constraint=dist.constraints.positive)
    inverse = dist.transforms.AffineTransform(loc, 2.0).inv
    composed = dist.transforms.ComposeTransform([inverse, dist.transforms.AffineTransform(0.0, scale)])
    pyro.sample("theta", dist.TransformedDistribution(dist.Normal(x.new_zeros(()), 1.0), [composed]))


def test_an_inverse_transform_in_the_guide_is_kept():
    def model(x):
        theta = pyro.sample("theta", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("data", x.shape[-1], dim=-1):
            pyro.sample("x", dist.Normal(theta, 1.0), obs=x)

    pyro.clear_param_store()
    x = torch.randn(5)
    eager, program = TMC_ELBO(4, 1), TMC_ELBO(4, 1, compile="graph")
    _loss_and_grads(eager, model, inverse_transform_guide, (x,), 0)
    for seed in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # traced, no fallback
            result = _loss_and_grads(program, model, inverse_transform_guide, (x,), seed)
        _assert_same(_loss_and_grads(eager, model, inverse_transform_guide, (x,), seed), result)
    assert program.program.traces == 1


def _writes_into_broadcast_zeros(x, rows, columns, values):
    """A loop-rolled step's pattern: a shared ``zeros`` expanded along the stacked dim, written into."""
    zeros = torch.ops.aten.expand.default(torch.ops.aten.new_zeros.default(x, [4]), [2, 4])
    put = torch.ops.aten.index_put.default(zeros, [rows, columns], values, True)
    overwritten = torch.ops.aten.index_put.default(zeros, [rows, columns], values, False)
    added = torch.ops.aten.index_add.default(zeros, 1, columns[:2], x[:4].reshape(2, 2))
    copied = torch.ops.aten.index_copy.default(zeros, 1, columns[:1], x[:2].reshape(2, 1))
    return put * 1.0, overwritten * 1.0, added * 1.0, copied * 1.0


def test_inductor_writes_into_each_row_of_a_broadcast_destination():
    """
    Inductor (torch 2.13) wrote ``index_put``, ``index_add`` and ``index_copy`` into an expanded
    operand through its broadcast layout: every row got every row's values. The fuzzer found it
    as a doubled gradient under ``TMC_RWS`` (seed 1724, general family, inductor oracle).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from pyro_tmc.compile import CompileConfig
    from pyro_tmc.compile.compiled import compiled_step_graph

    x = torch.randn(6)
    rows, columns, values = torch.tensor([0, 1, 1]), torch.tensor([2, 2, 3]), torch.tensor([1.0, 10.0, 100.0])
    graph = make_fx(_writes_into_broadcast_zeros)(x, rows, columns, values)
    expected = _writes_into_broadcast_zeros(x, rows, columns, values)
    with torch.no_grad():
        compiled = compiled_step_graph(graph, CompileConfig())(x, rows, columns, values)
    for want, got in zip(expected, compiled):
        assert torch.equal(got, want), (want, got)
