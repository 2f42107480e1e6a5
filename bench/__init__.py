"""Benchmarks (not tests): figures are printed and explained, never asserted in unit tests."""
