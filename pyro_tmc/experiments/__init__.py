"""The paper's experiments."""
