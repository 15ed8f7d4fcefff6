"""The old home of the shared queue: each ``gradientmail.patterns.X`` re-exports ``gradientmail.queue.X``.

Kept so that documented imports (the seed's ``from gradientmail.patterns.shared_queue import
shared_queue``) and existing scripts keep working; new code imports ``gradientmail.queue``.
"""
