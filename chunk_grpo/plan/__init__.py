"""Memory before anything is allocated: a run's plan per phase, bounds that refuse it."""
