"""Home of the seed's documented import path, ``gradientmail.patterns.shared_queue`` (nothing else)."""
