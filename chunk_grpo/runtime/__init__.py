"""Where a run executes: ranks, sharding, mixed precision, weight dtypes, quiet output."""
