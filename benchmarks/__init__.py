"""Benchmarks: one script per question, each ending with one JSON object on its last line."""
