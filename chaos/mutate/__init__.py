"""`python -m chaos mutate`: the harness measures its own strength on the engine's own code.

Each mutant is one small change to one function of the engine (a comparison flipped, a
number off by one, an argument dropped, a `break` turned into `continue`...). The harness
runs its scenario suite in the simulator (and, with `--explore N`, N swarm seeds of each
scenario) against each mutant alone: a mutant is *killed* when a scenario fails (a broken
invariant, a budget, or an `engine_error` verdict), *crashed* when the simulator raised
instead of giving a verdict (a kill, listed apart), *timeout* when the run did not end
within the per-mutant timeout (an infinite loop: a kill, listed apart), and *survived* when
every scenario passed: a bug the harness would not catch. Score = (killed + crashed +
timeout) / (mutants - equivalent).

Why mutmut (3.x) and not cosmic-ray: mutmut's mutations are libcst node rewrites
(`mutmut.mutation.file_mutation.create_mutations`) that give each mutant as a pair of
nodes tagged with the function that contains it, which is exactly the "per file and
function" grain asked for, and it honours `# pragma: no mutate`; its operator set is the
broader of the two for Python 3.11 code (string, number, keyword, name, argument removal,
call-to-None, augmented assignment, `match` case removal). cosmic-ray's operators are
parso-based and its runner is built around a session database and a distributor that
rewrites the file in place between test commands, which would serialise the runs on one
checkout. We use only mutmut's generation: its runner is tied to pytest and its trampoline
rewrites every function of a file (a wrapper around generators, which the engine's shell
is made of); here each mutant's whole-file source is compiled in a fresh interpreter in
place of the original module (an import hook, `chaos/mutate/worker.py`), so the mutated
code is the engine's own code with one change and nothing around it.

Layout: `generate.py` (targets and mutants), `worker.py` (one mutant, one interpreter,
one verdict), `run.py` (the baseline, the pool, timeouts, the temp dir), `report.py`
(JSON, markdown, the table), `command.py` (the subcommand), `equivalent.toml` (the
mutants recorded as equivalent, one line of why each).
"""
