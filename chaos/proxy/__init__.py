"""Our own Toxiproxy: the 2.x HTTP API and TCP proxies, with every random draw seeded.

No Toxiproxy binary can be installed where the harness runs, and the real one draws its
toxicity and jitter from an unseeded global source, so a run could not be replayed. This
server speaks the same API (any Toxiproxy client drives it) and draws each connection's
chances from the run's seed (`model.toxic_rng`), so a seed replays the same faults.
"""

import logging

# A library's logger: silent unless the program configures logging (`python -m chaos proxy`
# does; a chaos run does not, so a proxy that cannot reach a killed service says nothing
# on the run's terminal).
logging.getLogger(__name__).addHandler(logging.NullHandler())
