"""A check of the gym's gold for the 100-day stochastic volatility: NumPyro's NUTS, long chains.

    python benchmarks/numpyro_volatility.py --seed 3                 # 100,000 draws, about a minute
    python benchmarks/numpyro_volatility.py --seed 3 --draws 20000
    python benchmarks/numpyro_volatility.py --seed 3 4 5 \\
        --out benchmarks/results/stochastic_volatility_small_numpyro.json

With ``--out``, the runs' draws are pooled and every gold parameter's mean and sd (the three globals and
the 100 days, as gym parameters) written as JSON: ``benchmarks/gold.py`` scores its 100-day volatility
rows against it too ("vs NumPyro"), beside the gold.

Needs the ``peers`` extra (NumPyro and JAX; ``pip install -e ".[peers]"``) and Inference Gym's data
(``pip install --no-deps inference-gym``). The model is ``benchmarks/gold.py``'s
``stochastic_volatility_model`` written in NumPyro, centered as the gym writes it (the days are the
log volatilities themselves), in float64, on the same 100 centered S&P 500 returns. It prints each
global's mean and sd, the run's divergences and the effective draws of ``mean_log_volatility``.

Measured (NumPyro 0.22.0, jax 0.10.2, target acceptance 0.95, 3,000 warm-up draws, 100,000 draws,
no divergences in any run), against the gold (Stan, 50,000 draws): ``mean_log_volatility``'s mean
7.842, 7.859 and 7.856 (seeds 3, 4, 5; gold 7.915, its standard error 0.0045), its sd 1.284, 1.263 and
1.241 (gold 1.048), with 28,000-33,000 effective draws a run; persistence's sd 0.0474-0.0481 (gold
0.0476), the shock scale's 0.1391-0.1415 (gold 0.1395). ``mean_log_volatility``'s marginal has a long
left tail (kurtosis 9.6), which is where the gold and these runs part.
"""

import argparse
import json
import time

import numpy as np


def returns_of_the_last(num_days: int = 100) -> np.ndarray:
    """The gym's ``sp500_returns(num_days)``: the last daily price differences, centered."""
    from inference_gym.internal.datasets import sp500_closing_prices

    returns = np.diff(np.asarray(sp500_closing_prices.CLOSING_PRICES, dtype=np.float64))[-num_days:]
    return returns - returns.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="one run per seed")
    parser.add_argument("--out", help="a JSON file for the pooled moments")
    parser.add_argument("--draws", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--target-accept", type=float, default=0.95)
    options = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.diagnostics import effective_sample_size
    from numpyro.infer import MCMC, NUTS
    from numpyro.infer.initialization import init_to_value

    jax.config.update("jax_enable_x64", True)
    returns = returns_of_the_last()

    def model(returns):
        persistence = 2 * numpyro.sample("persistence_01", dist.Beta(20.0, 1.5)) - 1
        mean = numpyro.sample("mean_log_volatility", dist.Cauchy(0.0, 5.0))
        shock = numpyro.sample("white_noise_shock_scale", dist.HalfCauchy(2.0))
        # the days as one vector, scored by the AR(1) chain: its Normal base density is taken back out
        days = numpyro.sample("log_volatility", dist.Normal(0.0, 1.0).expand([len(returns)]).to_event(1))
        chain = dist.Normal(mean, shock / jnp.sqrt(1 - persistence**2)).log_prob(days[0])
        chain += dist.Normal(mean + persistence * (days[:-1] - mean), shock).log_prob(days[1:]).sum()
        numpyro.factor("chain", chain - dist.Normal(0.0, 1.0).log_prob(days).sum())
        numpyro.sample("returns", dist.Normal(0.0, jnp.exp(days / 2)), obs=returns)

    start_value = float(np.log(np.mean(returns**2)))  # as gold.py starts: the data's variance
    start = {
        "persistence_01": 0.95,
        "mean_log_volatility": start_value,
        "white_noise_shock_scale": 0.5,
        "log_volatility": np.full(len(returns), start_value),
    }
    pooled = []
    for seed in options.seed:
        kernel = NUTS(
            model, target_accept_prob=options.target_accept, init_strategy=init_to_value(values=start)
        )
        mcmc = MCMC(kernel, num_warmup=options.warmup, num_samples=options.draws, progress_bar=False)
        began = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(returns), extra_fields=("diverging",))
        samples = mcmc.get_samples()
        divergences = int(mcmc.get_extra_fields()["diverging"].sum())
        print(f"seed {seed}: {time.perf_counter() - began:.0f} s, {divergences} divergences")
        values = {
            "persistence_of_volatility": 2 * np.asarray(samples["persistence_01"]) - 1,
            "mean_log_volatility": np.asarray(samples["mean_log_volatility"]),
            "white_noise_shock_scale": np.asarray(samples["white_noise_shock_scale"]),
        }
        for name, value in values.items():
            effective = float(effective_sample_size(value[None]))
            print(f"{name}: mean {value.mean():.4f}, sd {value.std():.4f}, effective draws {effective:.0f}")
        values["log_volatility"] = np.asarray(samples["log_volatility"])
        pooled.append(values)
    if options.out:
        moments = {}
        for name in pooled[0]:
            draws = np.concatenate([values[name] for values in pooled])
            moments[name] = {"mean": draws.mean(0).tolist(), "sd": draws.std(0).tolist()}
        moments["draws"] = len(options.seed) * options.draws
        with open(options.out, "w") as handle:
            json.dump(moments, handle, indent=1)
        print(f"pooled moments of {moments['draws']} draws written to {options.out}")


if __name__ == "__main__":
    main()
