"""Systems under test: each durable design behind one seam (see `chaos.systems.seam`)."""
