"""The PostgreSQL designs' mutants: a broken database, installed in the run's database.

On `pg-store` the guarantees a mutant removes live in the database (each store operation is
one PL/pgSQL function of `engine/runtime/migrations`), so these mutants break the database,
not the worker: `install` replaces the function(s) of a mutant, as the schema's owner, by a
broken twin derived from the definition the database holds (`pg_get_functiondef`), and
returns a `restore()` that puts the shipped definition back. On `pg` the job queue is a
table too, and a mutant may change the table itself: `pg_jobs_unlogged` makes `eai.jobs`
UNLOGGED (`ALTER TABLE ... SET UNLOGGED`, undone by `SET LOGGED`), so the crash recovery
of a killed PostgreSQL empties it. The live adapter calls `install` when the run starts
(with an administrator's connection to the run's database) and `restore` when it stops.
The workers run the engine unpatched: their side of these mutants in
`chaos.mutants.MUTANTS` does nothing, and the simulator's counterpart is the same misstep
of the function's Python reference, or of the table's model (`chaos.insim.mutants.PATCHED`).

Each broken twin is the shipped text changed by exact replacements, each of a pattern that
must occur exactly once: a function that no longer has it raises `SeamGone`, as does a table
that is unlogged already, so a mutant never silently runs the correct engine.
`CREATE OR REPLACE FUNCTION` keeps the function's owner and grants, so the engine's role
runs the broken one as it ran the right one; so does `ALTER TABLE`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

#: The migrations' lock (`engine.runtime.pgstore.migrate`): a mutant installed or removed
#: while a migration runs waits for it.
_LOCK = "SELECT pg_advisory_xact_lock(hashtext('eai.migrations'))"


class SeamGone(RuntimeError):
    """A shipped function no longer has what its mutant changes."""


@dataclass(frozen=True)
class Edit:
    """One replacement: `pattern` (a regular expression, whitespace-tolerant where it says
    `\\s+`) must match the definition exactly once; `replacement` is its text (no group
    references)."""

    pattern: str
    replacement: str


@dataclass(frozen=True)
class FunctionEdit:
    function: str  # schema-qualified: eai.write_status
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class SqlMutant:
    name: str  # as in chaos.mutants.MUTANTS
    description: str
    functions: tuple[FunctionEdit, ...]
    #: Tables made UNLOGGED (schema-qualified): no WAL, so a crash recovery truncates them.
    unlogged: tuple[str, ...] = ()


#: A fenced function's refusal and its lease run on (`_fence_on`): the refusal goes, the
#: lease runs on only when the fence would have let the write through, so a stale token's
#: write lands without taking the lease back (Redis's `fenced` with its `return` removed).
_UNFENCE = Edit(
    r"IF v_other IS NOT NULL THEN\s+RETURN ARRAY\['!fenced', v_other\];\s+END IF;\s+"
    r"r := eai\._fence_on\(r, p_token, p_lease_ms, v_now\);",
    "IF v_other IS NULL THEN  -- mutant: a refused write lands all the same\n"
    "        r := eai._fence_on(r, p_token, p_lease_ms, v_now);\n"
    "    END IF;",
)

SQL_MUTANTS: dict[str, SqlMutant] = {
    m.name: m
    for m in (
        SqlMutant(
            "pg_unfenced",
            "eai.write_status skips its fence: a stale owner's status lands",
            (FunctionEdit("eai.write_status", (_UNFENCE,)),),
        ),
        SqlMutant(
            "pg_overwrite_result",
            "eai.write_result keeps the last result, past its fence, and says every write won",
            (
                FunctionEdit(
                    "eai.write_result",
                    (
                        _UNFENCE,
                        Edit(
                            r"SET result = coalesce\(result, p_result\),",
                            "SET result = p_result,  -- mutant: the last write wins\n       ",
                        ),
                        Edit(
                            r"out := ARRAY\[coalesce\(v_kept, ''\), ''\];",
                            "out := ARRAY['', ''];  -- mutant: every write won",
                        ),
                    ),
                ),
            ),
        ),
        SqlMutant(
            "pg_double_claim",
            "eai.begin skips its lease check: a second worker takes a run its owner holds",
            (
                FunctionEdit(
                    "eai.begin",
                    (
                        Edit(
                            r"IF v_holder IS NOT NULL AND v_holder <> p_me THEN\s+"
                            r"RETURN ARRAY\['held', v_holder\];\s+END IF;",
                            "-- mutant: the lease is not looked at",
                        ),
                    ),
                ),
            ),
        ),
        SqlMutant(
            "pg_resume_forgets",
            "eai.resume deletes every checkpoint, the kept ones too, and names only the later "
            "ones deleted",
            (
                FunctionEdit(
                    "eai.resume",
                    (
                        Edit(
                            r"WHERE c\.run_id = r\.id AND \(c\.number IS NULL OR c\.id IN "
                            r"\(SELECT id FROM ranked WHERE n > v_from\)\)\s+RETURNING c\.rule_id",
                            "WHERE c.run_id = r.id  -- mutant: every checkpoint goes\n"
                            "        RETURNING CASE WHEN c.number IS NULL OR c.id IN (SELECT id "
                            "FROM ranked WHERE n > v_from) THEN c.rule_id END AS rule_id",
                        ),
                        Edit(
                            r"SELECT coalesce\(array_agg\(rule_id ORDER BY rule_id COLLATE "
                            r"\"C\"\), '\{\}'\) INTO v_gone FROM gone;",
                            "SELECT coalesce(array_remove(array_agg(rule_id ORDER BY rule_id "
                            "COLLATE \"C\"), NULL), '{}') INTO v_gone FROM gone;  -- mutant: "
                            "the kept ones are not named",
                        ),
                    ),
                ),
            ),
        ),
        SqlMutant(
            "pg_resume_keeps_owner",
            "eai.resume takes no lease: the owner keeps it, and its token",
            (
                FunctionEdit(
                    "eai.resume",
                    (
                        Edit(
                            r"r\.owner := NULL;\s+r\.lease_until_ms := NULL;\s+"
                            r"r\.fence := [^;]+;",
                            "-- mutant: the owner keeps its lease and its token",
                        ),
                    ),
                ),
            ),
        ),
        SqlMutant(
            "pg_pass_unfenced",
            "eai.mark_pass_published skips its fence: a stale owner's pass flag lands",
            (FunctionEdit("eai.mark_pass_published", (_UNFENCE,)),),
        ),
        SqlMutant(
            "pg_jobs_unlogged",
            "eai.jobs is UNLOGGED: a crash of PostgreSQL empties the job queue",
            (),
            unlogged=("eai.jobs",),
        ),
    )
}


def broken(name: str, function: str, definition: str) -> str:
    """`definition` (of `function`) as mutant `name` has it; `SeamGone` unless each of its
    patterns occurs exactly once."""
    (fe,) = [f for f in SQL_MUTANTS[name].functions if f.function == function]
    out = definition
    for edit in fe.edits:
        found = len(re.findall(edit.pattern, out))
        if found != 1:
            raise SeamGone(
                f"{name}: {function} changed: {edit.pattern!r} occurs {found} times in its "
                "definition, not once (is the mutant installed already?)"
            )
        out = re.sub(edit.pattern, lambda _, text=edit.replacement: text, out)
    return out


async def _definition(conn: asyncpg.Connection, function: str) -> tuple[int, str]:
    """The function's oid and its `CREATE OR REPLACE FUNCTION` text, as the database has it."""
    schema, _, proname = function.partition(".")
    rows = await conn.fetch(
        "SELECT p.oid, pg_get_functiondef(p.oid) AS def FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1 AND p.proname = $2",
        schema,
        proname,
    )
    if len(rows) != 1:
        raise SeamGone(f"{function}: {len(rows)} functions of that name, not one")
    return rows[0]["oid"], rows[0]["def"]


async def _persistence(conn: asyncpg.Connection, table: str) -> str:
    """`pg_class.relpersistence` of `table`: p (logged), u (unlogged)."""
    found = await conn.fetchval(
        "SELECT relpersistence::text FROM pg_class WHERE oid = to_regclass($1)", table
    )
    if found is None:
        raise SeamGone(f"{table}: no such table")
    return str(found)


async def install(
    conn: asyncpg.Connection, name: str | None
) -> Callable[[], Awaitable[None]] | None:
    """Replace the function(s) of SQL mutant `name` by their broken twins and make its
    tables unlogged, in one transaction, as the schema's owner (`conn`: an administrator's
    connection to the run's database); the `restore()` that puts the shipped definitions
    and logged tables back, on `conn` or on the connection it is given (`restore(other)`:
    one of the same rights, when `conn` may have been closed meanwhile, e.g. by a fault of
    the run). None, having done nothing, for None or a mutant that is not the database's."""
    mutant = SQL_MUTANTS.get(name) if name is not None else None
    if mutant is None:
        return None
    shipped: dict[str, str] = {}
    async with conn.transaction():
        await conn.execute(_LOCK)
        for fe in mutant.functions:
            oid, definition = await _definition(conn, fe.function)
            shipped[fe.function] = definition
            await conn.execute(broken(mutant.name, fe.function, definition))
            now = await conn.fetchval("SELECT pg_get_functiondef($1::oid)", oid)
            if now == definition:  # replaced by itself: the mutant would test nothing
                raise SeamGone(f"{mutant.name}: {fe.function} is unchanged after the install")
        for table in mutant.unlogged:
            if await _persistence(conn, table) != "p":
                raise SeamGone(
                    f"{mutant.name}: {table} is not a logged table (is the mutant installed "
                    "already?)"
                )
            await conn.execute(f"ALTER TABLE {table} SET UNLOGGED")
            if await _persistence(conn, table) != "u":
                raise SeamGone(f"{mutant.name}: {table} is still logged after the install")

    async def restore(on: asyncpg.Connection | None = None) -> None:
        """The shipped definitions and logged tables back, on `on` (a connection of the
        schema's owner) or, without one, on the install's, which must still be open."""
        c = on or conn
        if c.is_closed():
            raise RuntimeError(
                f"{mutant.name}: cannot restore {', '.join([*shipped, *mutant.unlogged])}: "
                "the install's connection is closed; pass restore() an open connection of the "
                "schema's owner"
            )
        async with c.transaction():
            await c.execute(_LOCK)
            for function, definition in shipped.items():
                await c.execute(definition)
                _, back = await _definition(c, function)
                if back != definition:
                    raise RuntimeError(f"{mutant.name}: {function} was not restored")
            for table in mutant.unlogged:
                await c.execute(f"ALTER TABLE {table} SET LOGGED")
                if await _persistence(c, table) != "p":
                    raise RuntimeError(f"{mutant.name}: {table} was not made logged again")

    return restore
