"""`dbos`: an evaluation as a DBOS workflow whose body is the engine's own core."""
