"""Home of the design note's documented import path, ``gradientmail.patterns.shared_queue`` (nothing else)."""
