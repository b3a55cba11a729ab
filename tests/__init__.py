"""pyro_tmc's tests: one folder per layer of the package (tests/ops, tests/infer, ...), and
what they share in tests/common. Run them with ``python -m pytest tests``."""
