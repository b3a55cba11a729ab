"""What the tests share: models with exact oracles (:mod:`tests.common.models`), models written
the way Pyro's examples write them (:mod:`tests.common.pyro_style_models`), and the cases and
comparisons of the capture tests (:mod:`tests.common.compile_cases`). No test imports another test."""

import pathlib

#: the checkout's root (benchmarks/, setup.cfg, tutorials/ are found from it)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
