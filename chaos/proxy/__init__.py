"""Our own Toxiproxy: the 2.x HTTP API and TCP proxies, with every random draw seeded.

No Toxiproxy binary can be installed where the harness runs, and the real one draws its
toxicity and jitter from an unseeded global source, so a run could not be replayed. This
server speaks the same API (any Toxiproxy client drives it) and draws each connection's
chances from the run's seed (`model.toxic_rng`), so a seed replays the same faults.
"""
