"""Training patterns built on the mailbox (the shared queue)."""
