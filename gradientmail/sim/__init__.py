"""Simulations of GradientMail runs on a virtual clock, for benchmarks and tests."""
