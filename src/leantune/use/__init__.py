"""Using what a run trained: ``leantune merge`` (an adapter folded into its base) and ``leantune generate``."""
