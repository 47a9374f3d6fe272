"""The deterministic simulator of the engine (built on the same pure core)."""
