"""`temporal`: an evaluation as a Temporal workflow whose body is the engine's own core."""
