"""The scheduler: which requests run in the next step, and how many of their tokens."""
