"""Tests that the scripts in benchmarks/ run and read what they should."""
