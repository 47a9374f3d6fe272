-- The engine's store on PostgreSQL: the durable design's schema `eai` (runs, run_steps,
-- checkpoints, run_events, tenant_id and row-level security) holding what the Redis store
-- keeps under `attempt:{attemptId}:*` and its two indexes, and one PL/pgSQL function per
-- store operation, each the twin of one Lua script of engine/runtime/store.py (proven equal
-- by tests/live/test_store_reference_live.py against the same Python references).
--
-- Mapping (Redis key -> here):
--   attempt:{a}:state / plan / fence / final_published / passes   runs columns
--   attempt:{a}:owner (a key with a PX lease)                      runs.owner, lease_until_ms
--   the running index ({ns}engine:running, score = last stamp)     runs.running_ms
--   attempt:{a}:rule:{r}:result / status                           checkpoints.result, status
--   the retries index ({ns}engine:retries, score = due time)       checkpoints.retry_due_ms
--   attempt:{a}:rule:{r}:runs (attempt -> starts)                  run_steps (one row an attempt)
--   {ns}engine:topology                                            topology
-- plus run_events, which Redis has no twin of: state transitions, fence tokens, statuses,
-- announcements (the audit trail of the durable design's `run.transition`).
--
-- Times: engine times are Unix ms (bigint) read once per function from the database's
-- clock (`eai.now_ms()`), or given (`p_now`, for tests that must control the clock); a key
-- is alive while its time is >= now, as a Redis key is until now > its PEXPIRETIME.
-- Retention replaces TTLs: a run (and all that hangs off it) expires `p_ttl` seconds after
-- its last write (`expires_at`), is treated as gone once past it (as an expired key is) and
-- is deleted lazily or by `eai.purge_expired`.
--
-- Concurrency: every operation on an evaluation first locks its `runs` row (FOR UPDATE),
-- so operations on one evaluation run one after the other, as scripts do in Redis; the
-- sweeper's claims skip a row that is locked (FOR UPDATE SKIP LOCKED): someone is busy with
-- that evaluation, so it is not stale now.

CREATE TABLE eai.runs (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    namespace text NOT NULL,
    attempt_id text NOT NULL,
    state text,
    plan text,                -- the plan JSON exactly as written (`begin` returns it)
    plan_rules text[],        -- its rule ids, read once when written (the retries' unindex)
    owner text,
    lease_until_ms bigint,    -- the owner holds the lease while this is >= now
    fence text,               -- the fence token `n:worker` of the last acquisition
    final_published boolean NOT NULL DEFAULT false,
    passes jsonb NOT NULL DEFAULT '{}',  -- pass id -> outcome, once published
    running_ms bigint,        -- in the running index since / stamped at (NULL: not in it)
    expires_at timestamptz NOT NULL,
    UNIQUE (tenant_id, namespace, attempt_id)
);
CREATE INDEX runs_running ON eai.runs (tenant_id, namespace, running_ms)
    WHERE running_ms IS NOT NULL;
CREATE INDEX runs_expiry ON eai.runs (tenant_id, expires_at);

-- A rule's durable record, what a resume reads back: its result (the first write wins),
-- its status (failed_attempt_N | permanently_failed) and its place in the retries index.
CREATE TABLE eai.checkpoints (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    run_id uuid NOT NULL REFERENCES eai.runs (id) ON DELETE CASCADE,
    rule_id text NOT NULL,
    result text,              -- RuleResult JSON exactly as written
    status text,
    retry_due_ms bigint,      -- in the retries index, due then (NULL: not in it)
    UNIQUE (run_id, rule_id)
);
CREATE INDEX checkpoints_retries ON eai.checkpoints (tenant_id, retry_due_ms)
    WHERE retry_due_ms IS NOT NULL;

-- One rule attempt: how many times it was started (more than once: a crash lost a run).
CREATE TABLE eai.run_steps (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    run_id uuid NOT NULL REFERENCES eai.runs (id) ON DELETE CASCADE,
    rule_id text NOT NULL,
    attempt integer NOT NULL,
    starts integer NOT NULL,
    UNIQUE (run_id, rule_id, attempt)
);

CREATE TABLE eai.run_events (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    run_id uuid NOT NULL REFERENCES eai.runs (id) ON DELETE CASCADE,
    kind text NOT NULL,       -- run.transition | lease.token | step.status | run.announced
    rule_id text,
    data jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX run_events_run ON eai.run_events (run_id, created_at);

-- The RabbitMQ queues and exchanges a namespace declared (`engine.submit --purge`).
CREATE TABLE eai.topology (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    namespace text NOT NULL,
    name text NOT NULL,
    expires_at timestamptz NOT NULL,
    UNIQUE (tenant_id, namespace, name)
);

-- Row-level security, forced on the tables' owner too: a transaction sees and writes the
-- rows of the tenant it set (`set_config('app.tenant_id', ..., true)`), none without one.
-- (Superusers and BYPASSRLS roles skip every policy: the engine refuses to run as one.)
DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['runs', 'checkpoints', 'run_steps', 'run_events', 'topology'] LOOP
        EXECUTE format('ALTER TABLE eai.%I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE eai.%I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format(
            'CREATE POLICY tenant_isolation ON eai.%I '
            'USING (tenant_id = nullif(current_setting(''app.tenant_id'', true), '''')::uuid) '
            'WITH CHECK (tenant_id = nullif(current_setting(''app.tenant_id'', true), '''')::uuid)',
            t
        );
    END LOOP;
END $$;

-- --- shared pieces ---------------------------------------------------------------------

-- What the operations read of a run and pass around: its row without the plan (which can
-- be large, and only `begin`, `reinstate` and the reads of it need).
CREATE TYPE eai.run_head AS (
    id uuid,
    tenant_id uuid,
    state text,
    has_plan boolean,
    owner text,
    lease_until_ms bigint,
    fence text,
    final_published boolean,
    passes jsonb,
    running_ms bigint,
    expires_at timestamptz
);

-- The database's clock in Unix ms (what Redis's TIME gives the scripts).
CREATE FUNCTION eai.now_ms() RETURNS bigint LANGUAGE sql VOLATILE
AS $$ SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

-- The transaction's tenant; an error without one (the store sets it in every transaction).
CREATE FUNCTION eai.tenant() RETURNS uuid LANGUAGE plpgsql STABLE AS $$
DECLARE
    t text := current_setting('app.tenant_id', true);
BEGIN
    IF t IS NULL OR t = '' THEN
        RAISE EXCEPTION 'app.tenant_id is not set in this transaction' USING ERRCODE = '42501';
    END IF;
    RETURN t::uuid;
END $$;

-- Whether an evaluation state is terminal (engine.core.states.TERMINAL_EVALUATION_STATUSES).
CREATE FUNCTION eai.terminal(p_state text) RETURNS boolean LANGUAGE sql IMMUTABLE
AS $$ SELECT coalesce(p_state IN ('cancelled', 'completed', 'failed', 'partial'), false) $$;

-- The worker a fence token `n:worker` names ('' when it has no colon, as Python's partition).
CREATE FUNCTION eai._me(p_token text) RETURNS text LANGUAGE sql IMMUTABLE
AS $$ SELECT CASE WHEN strpos(p_token, ':') > 0 THEN substr(p_token, strpos(p_token, ':') + 1)
              ELSE '' END $$;

-- Who holds the lease now: the owner while the lease runs, else nobody (an expired key).
CREATE FUNCTION eai._holder(r eai.run_head, p_now bigint) RETURNS text LANGUAGE sql IMMUTABLE
AS $$ SELECT CASE WHEN r.lease_until_ms >= p_now THEN r.owner END $$;

-- The rank of a stored status, as _WRITE_STATUS reads it (0 for anything unknown).
CREATE FUNCTION eai._rank(p_status text) RETURNS bigint LANGUAGE sql IMMUTABLE
AS $$ SELECT CASE WHEN p_status = 'permanently_failed' THEN 1000000
              ELSE coalesce(substring(p_status FROM '^failed_attempt_([0-9]+)$')::bigint, 0)
              END $$;

-- The rule ids a plan names (`unindex_retries` decodes the plan for them; here they are
-- read once, when the plan is written). A plan that is not JSON names none.
CREATE FUNCTION eai._plan_rules(p_plan text) RETURNS text[] LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    j jsonb;
BEGIN
    BEGIN
        j := p_plan::jsonb;
    EXCEPTION WHEN others THEN
        RETURN '{}';
    END;
    RETURN (
        SELECT coalesce(array_agg(r.value ->> 'id' ORDER BY p.n, r.n), '{}')
        FROM jsonb_array_elements(CASE WHEN jsonb_typeof(j -> 'passes') = 'array'
                                       THEN j -> 'passes' ELSE '[]' END)
             WITH ORDINALITY AS p (value, n),
             jsonb_array_elements(CASE WHEN jsonb_typeof(p.value -> 'rules') = 'array'
                                       THEN p.value -> 'rules' ELSE '[]' END)
             WITH ORDINALITY AS r (value, n)
        WHERE jsonb_typeof(r.value -> 'id') = 'string'
    );
END $$;

-- The evaluation's row, locked for the rest of the transaction (every operation on one
-- evaluation takes this lock first: they run one after the other). `p_create`: make the row
-- when there is none (the operation writes even then, as a script's first SET creates a
-- key); otherwise an absent row comes back as all NULLs. A row past its retention is gone.
CREATE FUNCTION eai._run(p_ns text, p_attempt text, p_create boolean, p_ttl integer)
RETURNS eai.run_head LANGUAGE plpgsql AS $$
DECLARE
    t uuid := eai.tenant();
    r eai.run_head;
BEGIN
    SELECT id, tenant_id, state, plan IS NOT NULL, owner, lease_until_ms, fence, final_published,
           passes, running_ms, expires_at
    INTO r FROM eai.runs
    WHERE tenant_id = t AND namespace = p_ns AND attempt_id = p_attempt
    FOR UPDATE;
    IF r.id IS NOT NULL AND r.expires_at < now() THEN
        DELETE FROM eai.runs WHERE id = r.id;
        r := NULL;
    END IF;
    IF r.id IS NULL AND p_create THEN
        INSERT INTO eai.runs (tenant_id, namespace, attempt_id, expires_at)
        VALUES (t, p_ns, p_attempt, now() + make_interval(secs => p_ttl))
        ON CONFLICT (tenant_id, namespace, attempt_id) DO NOTHING
        RETURNING id, tenant_id, state, plan IS NOT NULL, owner, lease_until_ms, fence, final_published,
                  passes, running_ms, expires_at
        INTO r;
        IF r.id IS NULL THEN  -- another transaction made it meanwhile: wait for it
            SELECT id, tenant_id, state, plan IS NOT NULL, owner, lease_until_ms, fence, final_published,
                   passes, running_ms, expires_at
            INTO r FROM eai.runs
            WHERE tenant_id = t AND namespace = p_ns AND attempt_id = p_attempt
            FOR UPDATE;
        END IF;
    END IF;
    RETURN r;
END $$;

-- `_run` for a claim: NULL when another transaction holds the row (it is busy, not stale).
CREATE FUNCTION eai._run_unless_locked(p_ns text, p_attempt text) RETURNS eai.run_head
LANGUAGE plpgsql AS $$
DECLARE
    r eai.run_head;
BEGIN
    SELECT id, tenant_id, state, plan IS NOT NULL, owner, lease_until_ms, fence, final_published,
           passes, running_ms, expires_at
    INTO r FROM eai.runs
    WHERE tenant_id = eai.tenant() AND namespace = p_ns AND attempt_id = p_attempt
    FOR UPDATE SKIP LOCKED;
    IF r.id IS NOT NULL AND r.expires_at < now() THEN
        DELETE FROM eai.runs WHERE id = r.id;
        r := NULL;
    END IF;
    RETURN r;
END $$;

-- Write back the evaluation's row `r` (read as `r0`) with its retention refreshed, unless
-- that would change nothing (a batch's later operations on one evaluation usually change
-- nothing more: each row version they would add is one more for the next lookup to walk);
-- `p_touched`: rows of its own elsewhere were written (their retention is the run's);
-- `p_plan`: a plan to store. Its transitions go to run_events.
CREATE FUNCTION eai._save(r0 eai.run_head, r eai.run_head, p_ttl integer,
                          p_touched boolean DEFAULT false, p_plan text DEFAULT NULL)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_expires timestamptz := now() + make_interval(secs => p_ttl);
BEGIN
    IF r.id IS NULL OR (r IS NOT DISTINCT FROM r0 AND (NOT p_touched OR r.expires_at = v_expires))
    THEN
        RETURN;
    END IF;
    UPDATE eai.runs SET
        state = r.state, owner = r.owner, lease_until_ms = r.lease_until_ms, fence = r.fence,
        final_published = r.final_published, passes = r.passes, running_ms = r.running_ms,
        updated_at = now(), expires_at = v_expires
    WHERE id = r.id;
    IF p_plan IS NOT NULL THEN
        UPDATE eai.runs SET plan = p_plan, plan_rules = eai._plan_rules(p_plan) WHERE id = r.id;
    END IF;
    IF r.state IS DISTINCT FROM r0.state THEN
        INSERT INTO eai.run_events (tenant_id, run_id, kind, data)
        VALUES (r.tenant_id, r.id, 'run.transition',
                jsonb_build_object('from', r0.state, 'to', r.state));
    END IF;
    IF r.fence IS DISTINCT FROM r0.fence THEN
        INSERT INTO eai.run_events (tenant_id, run_id, kind, data)
        VALUES (r.tenant_id, r.id, 'lease.token', jsonb_build_object('token', r.fence));
    END IF;
    IF r.final_published AND NOT coalesce(r0.final_published, false) THEN
        INSERT INTO eai.run_events (tenant_id, run_id, kind) VALUES (r.tenant_id, r.id, 'run.announced');
    END IF;
END $$;

-- The fence (`fenced` of the Lua scripts): who refuses an owner's write, the current token
-- or another live holder; NULL when it lands (an empty token: an unfenced write).
CREATE FUNCTION eai._refused(r eai.run_head, p_token text, p_now bigint) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_token = '' THEN NULL
        WHEN r.fence IS NOT NULL AND r.fence <> p_token THEN r.fence
        WHEN eai._holder(r, p_now) <> eai._me(p_token) THEN eai._holder(r, p_now)
    END
$$;

-- A fenced write lands: a token the row lost is written back (nobody acquired since: that
-- would have written one) and the lease runs on from now.
CREATE FUNCTION eai._fence_on(r eai.run_head, p_token text, p_lease_ms bigint, p_now bigint)
RETURNS eai.run_head LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_token <> '' THEN
        r.fence := coalesce(r.fence, p_token);
        r.owner := eai._me(p_token);
        r.lease_until_ms := p_now + p_lease_ms;
    END IF;
    RETURN r;
END $$;

-- Every rule of the evaluation's plan out of the retries index (`unindex_retries`).
-- Nothing to do (the usual case) costs one index probe: the plan is read only when one
-- of the evaluation's rules is indexed, as the Lua decodes it only then.
CREATE FUNCTION eai._unindex_retries(r eai.run_head) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_rules text[];
BEGIN
    IF r.id IS NULL OR NOT r.has_plan OR NOT EXISTS (
        SELECT 1 FROM eai.checkpoints WHERE run_id = r.id AND retry_due_ms IS NOT NULL
    ) THEN
        RETURN;
    END IF;
    SELECT plan_rules INTO v_rules FROM eai.runs WHERE id = r.id;
    UPDATE eai.checkpoints SET retry_due_ms = NULL, updated_at = now()
    WHERE run_id = r.id AND rule_id = ANY (v_rules) AND retry_due_ms IS NOT NULL;
END $$;

-- Count the starts of rule attempts, in order; with `p_unindex` (_MARK_STARTED) a delayed
-- retry's attempt (attempt > 1) also leaves the retries index as it starts.
CREATE FUNCTION eai._count_starts(r eai.run_head, p_rules text[], p_attempts integer[],
                                  p_unindex boolean)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    out text[] := '{}';
    n integer;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_rules, 1), 0) LOOP
        IF p_unindex AND p_attempts[i] > 1 THEN
            UPDATE eai.checkpoints SET retry_due_ms = NULL, updated_at = now()
            WHERE run_id = r.id AND rule_id = p_rules[i] AND retry_due_ms IS NOT NULL;
        END IF;
        INSERT INTO eai.run_steps AS s (tenant_id, run_id, rule_id, attempt, starts)
        VALUES (r.tenant_id, r.id, p_rules[i], p_attempts[i], 1)
        ON CONFLICT (run_id, rule_id, attempt)
        DO UPDATE SET starts = s.starts + 1, updated_at = now()
        RETURNING s.starts INTO n;
        out := out || n::text;
    END LOOP;
    RETURN out;
END $$;

-- A status written (and its retry indexed or not) as the run_events trail records it.
CREATE FUNCTION eai._put_status(r eai.run_head, p_rule text, p_status text, p_due bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO eai.checkpoints AS c (tenant_id, run_id, rule_id, status, retry_due_ms)
    VALUES (r.tenant_id, r.id, p_rule, p_status, p_due)
    ON CONFLICT (run_id, rule_id)
    DO UPDATE SET status = excluded.status, retry_due_ms = excluded.retry_due_ms,
                  updated_at = now();
    INSERT INTO eai.run_events (tenant_id, run_id, kind, rule_id, data)
    VALUES (r.tenant_id, r.id, 'step.status', p_rule, jsonb_build_object('status', p_status));
END $$;

-- --- the operations: one function each, the twin of one Lua script ------------------------
-- A fenced operation's reply starts '!fenced' with the current token or holder when the
-- fence refused it (nothing written); the store raises LeaseLost.

-- _BEGIN: take the lease and a new fence token, store the plan, load every rule.
-- Replies {'held', holder} | {'terminal', state, '1' or ''} | {'noplan'} |
-- {'ok', plan, token, number of passes, passes..., results..., statuses...} (NULL: none).
CREATE FUNCTION eai.begin(p_ns text, p_attempt text, p_me text, p_rules text[], p_plan text,
                          p_lease_ms bigint, p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    v_plan text := nullif(p_plan, '');
    r eai.run_head := eai._run(p_ns, p_attempt, v_plan IS NOT NULL, p_ttl);
    r0 eai.run_head := r;
    v_holder text := eai._holder(r, v_now);
    v_store text;
    v_passes text[];
    v_values text[];
BEGIN
    IF v_holder IS NOT NULL AND v_holder <> p_me THEN
        RETURN ARRAY['held', v_holder];
    END IF;
    IF eai.terminal(r.state) THEN
        PERFORM eai._unindex_retries(r);
        IF r.final_published THEN
            r.running_ms := NULL;
        END IF;
        PERFORM eai._save(r0, r, p_ttl);
        RETURN ARRAY['terminal', r.state, CASE WHEN r.final_published THEN '1' ELSE '' END];
    END IF;
    IF v_plan IS NULL THEN
        SELECT plan INTO v_plan FROM eai.runs WHERE id = r.id;
    ELSIF NOT r.has_plan THEN
        v_store := v_plan;
        r.has_plan := true;
    END IF;
    IF v_plan IS NULL THEN
        RETURN ARRAY['noplan'];
    END IF;
    r.owner := p_me;
    r.lease_until_ms := v_now + p_lease_ms;
    r.fence := (coalesce(substring(r.fence FROM '^([0-9]+):')::bigint, 0) + 1)::text || ':' || p_me;
    r.state := 'running';
    r.running_ms := v_now;
    PERFORM eai._save(r0, r, p_ttl, false, v_store);
    SELECT array_agg(k ORDER BY k) INTO v_passes FROM jsonb_object_keys(r.passes) AS k;
    SELECT array_agg(c.result ORDER BY w.n) || array_agg(c.status ORDER BY w.n) INTO v_values
    FROM unnest(p_rules) WITH ORDINALITY AS w (rule_id, n)
    LEFT JOIN eai.checkpoints c ON c.run_id = r.id AND c.rule_id = w.rule_id;
    RETURN ARRAY['ok', v_plan, r.fence, coalesce(cardinality(v_passes), 0)::text]
        || coalesce(v_passes, '{}') || coalesce(v_values, '{}');
END $$;

-- _RENEW: the heartbeat of one evaluation. {1 or 2, when the lease runs out} or {0}: lost.
-- 2: the state was gone too (forgotten), and is the owner's again.
CREATE FUNCTION eai.renew(p_ns text, p_attempt text, p_me text, p_token text,
                          p_lease_ms bigint, p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head;
    r0 eai.run_head;
    v_holder text;
    v_forgotten boolean;
BEGIN
    IF p_token = '' THEN
        RETURN ARRAY[0];
    END IF;
    r := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 := r;
    v_holder := eai._holder(r, v_now);
    IF (r.fence IS NOT NULL AND r.fence <> p_token) OR (v_holder IS NOT NULL AND v_holder <> p_me) THEN
        RETURN ARRAY[0];
    END IF;
    r.fence := coalesce(r.fence, p_token);
    r.owner := p_me;
    r.lease_until_ms := v_now + p_lease_ms;
    v_forgotten := r.state IS NULL;
    IF v_forgotten THEN
        r.state := 'running';
    END IF;
    IF NOT eai.terminal(r.state) THEN
        r.running_ms := v_now;
    END IF;
    PERFORM eai._save(r0, r, p_ttl);
    RETURN ARRAY[CASE WHEN v_forgotten THEN 2 ELSE 1 END, r.lease_until_ms];
END $$;

-- _WRITE_RESULT: store a result (the first write wins), take the rule off the retries
-- index, count the starts of the rules it makes ready unless the evaluation is over.
-- {'' or the result kept, '' or the terminal state, start counts...}.
CREATE FUNCTION eai.write_result(p_ns text, p_attempt text, p_rule text, p_result text,
                                 p_start_rules text[], p_start_attempts integer[],
                                 p_token text, p_lease_ms bigint, p_ttl integer,
                                 p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
    v_other text := eai._refused(r, p_token, v_now);
    v_kept text;
    out text[];
BEGIN
    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
    r := eai._fence_on(r, p_token, p_lease_ms, v_now);
    SELECT c.result INTO v_kept FROM eai.checkpoints c WHERE c.run_id = r.id AND c.rule_id = p_rule;
    IF NOT FOUND THEN
        INSERT INTO eai.checkpoints (tenant_id, run_id, rule_id, result)
        VALUES (r.tenant_id, r.id, p_rule, p_result);
    ELSE
        UPDATE eai.checkpoints
        SET result = coalesce(result, p_result), retry_due_ms = NULL, updated_at = now()
        WHERE run_id = r.id AND rule_id = p_rule;
    END IF;
    out := ARRAY[coalesce(v_kept, ''), ''];
    IF eai.terminal(r.state) THEN
        out[2] := r.state;
    ELSE
        out := out || eai._count_starts(r, p_start_rules, p_start_attempts, false);
    END IF;
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN out;
END $$;

-- _WRITE_STATUS: a status, unless it would move the attempt count back; with a delay (and
-- an evaluation not over) the retry is indexed as due that long after now.
-- {'' or the status kept, '' or the terminal state, '' or the due time}.
CREATE FUNCTION eai.write_status(p_ns text, p_attempt text, p_rule text, p_status text,
                                 p_rank bigint, p_delay_ms bigint, p_token text,
                                 p_lease_ms bigint, p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
    v_other text := eai._refused(r, p_token, v_now);
    v_over text;
    v_cur text;
    v_due bigint;
BEGIN
    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
    r := eai._fence_on(r, p_token, p_lease_ms, v_now);
    IF eai.terminal(r.state) THEN
        v_over := r.state;
    END IF;
    SELECT c.status INTO v_cur FROM eai.checkpoints c WHERE c.run_id = r.id AND c.rule_id = p_rule;
    IF v_cur IS NOT NULL AND eai._rank(v_cur) >= p_rank THEN
        PERFORM eai._save(r0, r, p_ttl);
        RETURN ARRAY[v_cur, coalesce(v_over, ''), ''];
    END IF;
    IF p_delay_ms IS NOT NULL AND v_over IS NULL THEN
        v_due := v_now + p_delay_ms;
    END IF;
    PERFORM eai._put_status(r, p_rule, p_status, v_due);
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN ARRAY['', coalesce(v_over, ''), coalesce(v_due::text, '')];
END $$;

-- _MARK_STARTED: count the starts of rule attempts unless the evaluation is over.
-- {'' or the terminal state (nothing counted), start counts...}.
CREATE FUNCTION eai.mark_started(p_ns text, p_attempt text, p_start_rules text[],
                                 p_start_attempts integer[], p_token text, p_lease_ms bigint,
                                 p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt,
                           p_token <> '' OR coalesce(cardinality(p_start_rules), 0) > 0, p_ttl);
    r0 eai.run_head := r;
    v_other text := eai._refused(r, p_token, v_now);
    out text[];
BEGIN
    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
    r := eai._fence_on(r, p_token, p_lease_ms, v_now);
    IF eai.terminal(r.state) THEN
        PERFORM eai._save(r0, r, p_ttl);
        RETURN ARRAY[r.state];
    END IF;
    out := ARRAY[''] || eai._count_starts(r, p_start_rules, p_start_attempts, true);
    PERFORM eai._save(r0, r, p_ttl, cardinality(out) > 1);
    RETURN out;
END $$;

-- _MARK_PASS: a pass's result is published. {'1'}.
CREATE FUNCTION eai.mark_pass_published(p_ns text, p_attempt text, p_pass text, p_outcome text,
                                        p_token text, p_lease_ms bigint, p_ttl integer,
                                        p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
    v_other text := eai._refused(r, p_token, v_now);
BEGIN
    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
    r := eai._fence_on(r, p_token, p_lease_ms, v_now);
    r.passes := r.passes || jsonb_build_object(p_pass, p_outcome);
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN ARRAY['1'];
END $$;

-- _PARK: only delayed retries are left: parked, out of the running index, lease given
-- back; each retry waited for keeps its due time, or is indexed as due now if it had none.
CREATE FUNCTION eai.park(p_ns text, p_attempt text, p_me text, p_waiting text[], p_token text,
                         p_lease_ms bigint, p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
    v_other text := eai._refused(r, p_token, v_now);
BEGIN
    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
    r := eai._fence_on(r, p_token, p_lease_ms, v_now);
    IF NOT eai.terminal(r.state) THEN
        r.state := 'parked';
        INSERT INTO eai.checkpoints AS c (tenant_id, run_id, rule_id, retry_due_ms)
        SELECT DISTINCT r.tenant_id, r.id, w, v_now FROM unnest(p_waiting) AS w
        ON CONFLICT (run_id, rule_id)
        DO UPDATE SET retry_due_ms = coalesce(c.retry_due_ms, excluded.retry_due_ms),
                      updated_at = now();
    END IF;
    r.running_ms := NULL;
    IF eai._holder(r, v_now) = p_me THEN
        r.owner := NULL;
        r.lease_until_ms := NULL;
    END IF;
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN ARRAY['1'];
END $$;

-- _FINISH: the final state, once every result given and every permanent failure is stored
-- again (restored when missing). {'' or the terminal state kept, the rules restored...}.
CREATE FUNCTION eai.finish(p_ns text, p_attempt text, p_status text, p_result_rules text[],
                           p_results text[], p_failed text[], p_token text, p_lease_ms bigint,
                           p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
    v_other text := eai._refused(r, p_token, v_now);
    v_results text[];
    v_failed text[];
BEGIN
    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
    r := eai._fence_on(r, p_token, p_lease_ms, v_now);
    IF eai.terminal(r.state) THEN
        PERFORM eai._save(r0, r, p_ttl);
        RETURN ARRAY[r.state];
    END IF;
    SELECT coalesce(array_agg(w.rule_id ORDER BY w.n), '{}') INTO v_results
    FROM unnest(p_result_rules) WITH ORDINALITY AS w (rule_id, n)
    LEFT JOIN eai.checkpoints c ON c.run_id = r.id AND c.rule_id = w.rule_id
    WHERE c.result IS NULL;
    IF cardinality(v_results) > 0 THEN
        INSERT INTO eai.checkpoints AS c (tenant_id, run_id, rule_id, result)
        SELECT r.tenant_id, r.id, w.rule_id, w.result
        FROM unnest(p_result_rules, p_results) AS w (rule_id, result)
        WHERE w.rule_id = ANY (v_results)
        ON CONFLICT (run_id, rule_id) DO UPDATE SET result = excluded.result, updated_at = now();
    END IF;
    SELECT coalesce(array_agg(f.rule_id ORDER BY f.n), '{}') INTO v_failed
    FROM unnest(p_failed) WITH ORDINALITY AS f (rule_id, n)
    LEFT JOIN eai.checkpoints c ON c.run_id = r.id AND c.rule_id = f.rule_id
    WHERE c.status IS DISTINCT FROM 'permanently_failed';
    IF cardinality(v_failed) > 0 THEN
        INSERT INTO eai.checkpoints AS c (tenant_id, run_id, rule_id, status)
        SELECT DISTINCT r.tenant_id, r.id, f, 'permanently_failed' FROM unnest(v_failed) AS f
        ON CONFLICT (run_id, rule_id) DO UPDATE SET status = excluded.status, updated_at = now();
        INSERT INTO eai.run_events (tenant_id, run_id, kind, rule_id, data)
        SELECT r.tenant_id, r.id, 'step.status', f, '{"status": "permanently_failed"}'
        FROM unnest(v_failed) AS f;
    END IF;
    r.state := p_status;
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN ARRAY[''] || v_results || v_failed;
END $$;

-- _DONE: evaluation.completed is out: flag it, leave both indexes, give the lease back.
-- false, with nothing written, when the state is not terminal (any more).
CREATE FUNCTION eai.done(p_ns text, p_attempt text, p_me text, p_ttl integer,
                         p_now bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, false, p_ttl);
    r0 eai.run_head := r;
BEGIN
    IF NOT eai.terminal(r.state) THEN
        RETURN false;
    END IF;
    r.final_published := true;
    r.running_ms := NULL;
    PERFORM eai._unindex_retries(r);
    IF eai._holder(r, v_now) = p_me THEN
        r.owner := NULL;
        r.lease_until_ms := NULL;
    END IF;
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN true;
END $$;

-- _SET_STATE: a state, unless a terminal one is there (returned: it won); a terminal state
-- written takes the evaluation's rules off the retries index.
CREATE FUNCTION eai.set_state(p_ns text, p_attempt text, p_state text, p_ttl integer)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
BEGIN
    IF eai.terminal(r.state) THEN
        RETURN r.state;
    END IF;
    r.state := p_state;
    IF eai.terminal(p_state) THEN
        PERFORM eai._unindex_retries(r);
    END IF;
    PERFORM eai._save(r0, r, p_ttl, true);
    RETURN NULL;
END $$;

-- _RELEASE: give the lease back if it is `p_me`'s.
CREATE FUNCTION eai.release(p_ns text, p_attempt text, p_me text, p_ttl integer,
                            p_now bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, false, p_ttl);
    r0 eai.run_head := r;
BEGIN
    IF eai._holder(r, v_now) IS DISTINCT FROM p_me THEN
        RETURN false;
    END IF;
    r.owner := NULL;
    r.lease_until_ms := NULL;
    PERFORM eai._save(r0, r, p_ttl);
    RETURN true;
END $$;

-- _UNINDEX: out of the running and retries indexes (another final state won).
CREATE FUNCTION eai.unindex(p_ns text, p_attempt text, p_ttl integer) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r eai.run_head := eai._run(p_ns, p_attempt, false, p_ttl);
    r0 eai.run_head := r;
BEGIN
    r.running_ms := NULL;
    PERFORM eai._unindex_retries(r);
    PERFORM eai._save(r0, r, p_ttl);
    RETURN true;
END $$;

-- _CLAIM_STALE: the sweeper claims an evaluation whose stamp is older than the threshold
-- and whose lease nobody holds (restamped now); one terminal and announced leaves the index.
CREATE FUNCTION eai.claim_stale(p_ns text, p_attempt text, p_older_than_ms bigint,
                                p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run_unless_locked(p_ns, p_attempt);
    r0 eai.run_head := r;
BEGIN
    IF r.running_ms IS NULL OR r.running_ms > v_now - p_older_than_ms THEN
        RETURN false;
    END IF;
    IF eai.terminal(r.state) AND r.final_published THEN
        r.running_ms := NULL;
        PERFORM eai._save(r0, r, p_ttl);
        RETURN false;
    END IF;
    IF eai._holder(r, v_now) IS NOT NULL THEN
        RETURN false;
    END IF;
    r.running_ms := v_now;
    PERFORM eai._save(r0, r, p_ttl);
    RETURN true;
END $$;

-- _CLAIM_RETRY: the sweeper claims an overdue retry (due again a grace later) and reads the
-- rule's status with it ('' when not claimed, or no status); a terminal evaluation's
-- retry leaves the index instead.
CREATE FUNCTION eai.claim_retry(p_ns text, p_attempt text, p_rule text, p_grace_ms bigint,
                                p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run_unless_locked(p_ns, p_attempt);
    v_due bigint;
    v_status text;
BEGIN
    IF r.id IS NULL THEN
        RETURN '';
    END IF;
    SELECT c.retry_due_ms, c.status INTO v_due, v_status
    FROM eai.checkpoints c WHERE c.run_id = r.id AND c.rule_id = p_rule;
    IF v_due IS NULL OR v_due > v_now - p_grace_ms THEN
        RETURN '';
    END IF;
    IF eai.terminal(r.state) THEN
        v_due := NULL;
        v_status := '';
    ELSE
        v_due := v_now + p_grace_ms;
    END IF;
    UPDATE eai.checkpoints SET retry_due_ms = v_due, updated_at = now()
    WHERE run_id = r.id AND rule_id = p_rule;
    RETURN coalesce(v_status, '');
END $$;

-- --- the plain reads and commands (each one round trip, as on Redis) ---------------------

-- An evaluation's id as a read sees it (not locked; none once past its retention).
CREATE FUNCTION eai._peek(p_ns text, p_attempt text) RETURNS uuid LANGUAGE sql STABLE AS $$
    SELECT id FROM eai.runs
    WHERE tenant_id = eai.tenant() AND namespace = p_ns AND attempt_id = p_attempt
      AND expires_at >= now()
$$;

-- Every rule's result and status, and the passes published: {"results": [...],
-- "statuses": [...], "passes": [...]} (results and statuses in the order of `p_rules`).
CREATE FUNCTION eai.snapshot(p_ns text, p_attempt text, p_rules text[]) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_id uuid := eai._peek(p_ns, p_attempt);
BEGIN
    RETURN (
        SELECT jsonb_build_object(
            'results', coalesce(jsonb_agg(c.result ORDER BY w.n), '[]'),
            'statuses', coalesce(jsonb_agg(c.status ORDER BY w.n), '[]'),
            'passes', coalesce((SELECT jsonb_agg(k) FROM eai.runs r, jsonb_object_keys(r.passes) k
                                WHERE r.id = v_id), '[]'))
        FROM unnest(p_rules) WITH ORDINALITY AS w (rule_id, n)
        LEFT JOIN eai.checkpoints c ON c.run_id = v_id AND c.rule_id = w.rule_id
    );
END $$;

-- {state, plan, '1' or ''}: the evaluation as a whole.
CREATE FUNCTION eai.record(p_ns text, p_attempt text) RETURNS text[] LANGUAGE sql STABLE AS $$
    SELECT coalesce((
        SELECT ARRAY[r.state, r.plan, CASE WHEN r.final_published THEN '1' ELSE '' END]
        FROM eai.runs r WHERE r.id = eai._peek(p_ns, p_attempt)), ARRAY[NULL, NULL, ''])
$$;

CREATE FUNCTION eai.stored_plan(p_ns text, p_attempt text) RETURNS text LANGUAGE sql STABLE
AS $$ SELECT plan FROM eai.runs WHERE id = eai._peek(p_ns, p_attempt) $$;

-- Who holds the lease now (a look: it decides nothing).
CREATE FUNCTION eai.holder(p_ns text, p_attempt text, p_now bigint DEFAULT NULL) RETURNS text
LANGUAGE sql VOLATILE AS $$
    SELECT owner FROM eai.runs
    WHERE id = eai._peek(p_ns, p_attempt) AND lease_until_ms >= coalesce(p_now, eai.now_ms())
$$;

-- Write back the plan unless one is there; true when it had vanished.
CREATE FUNCTION eai.reinstate(p_ns text, p_attempt text, p_plan text, p_ttl integer)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    r eai.run_head := eai._run(p_ns, p_attempt, true, p_ttl);
    r0 eai.run_head := r;
BEGIN
    IF r.has_plan THEN
        RETURN false;
    END IF;
    r.has_plan := true;
    PERFORM eai._save(r0, r, p_ttl, false, p_plan);
    RETURN true;
END $$;

-- The running index up to a stamp `p_older_than_ms` old, oldest first (then by attemptId,
-- bytewise: ZRANGEBYSCORE's order).
CREATE FUNCTION eai.stale_evaluations(p_ns text, p_older_than_ms bigint, p_limit integer,
                                      p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(array_agg(s.attempt_id ORDER BY s.running_ms, s.attempt_id COLLATE "C"), '{}')
    FROM (
        SELECT attempt_id, running_ms FROM eai.runs
        WHERE tenant_id = eai.tenant() AND namespace = p_ns AND expires_at >= now()
          AND running_ms <= coalesce(p_now, eai.now_ms()) - p_older_than_ms
        ORDER BY running_ms, attempt_id COLLATE "C"
        LIMIT p_limit
    ) s
$$;

-- The retries index up to a due time `p_grace_ms` ago, as members `attemptId<US>ruleId`.
CREATE FUNCTION eai.overdue_retries(p_ns text, p_grace_ms bigint, p_limit integer,
                                    p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(array_agg(s.member ORDER BY s.due, s.member COLLATE "C"), '{}')
    FROM (
        SELECT r.attempt_id || chr(31) || c.rule_id AS member, c.retry_due_ms AS due
        FROM eai.checkpoints c JOIN eai.runs r ON r.id = c.run_id
        WHERE c.tenant_id = eai.tenant() AND r.namespace = p_ns AND r.expires_at >= now()
          AND c.retry_due_ms <= coalesce(p_now, eai.now_ms()) - p_grace_ms
        ORDER BY c.retry_due_ms, (r.attempt_id || chr(31) || c.rule_id) COLLATE "C"
        LIMIT p_limit
    ) s
$$;

CREATE FUNCTION eai.remember_topology(p_ns text, p_names text[], p_ttl integer)
RETURNS boolean LANGUAGE sql VOLATILE AS $$
    INSERT INTO eai.topology (tenant_id, namespace, name, expires_at)
    SELECT DISTINCT eai.tenant(), p_ns, n, now() + make_interval(secs => p_ttl)
    FROM unnest(p_names) AS n
    ON CONFLICT (tenant_id, namespace, name)
    DO UPDATE SET expires_at = excluded.expires_at, updated_at = now();
    SELECT true
$$;

CREATE FUNCTION eai.topology(p_ns text) RETURNS text[] LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM eai.topology
    WHERE tenant_id = eai.tenant() AND namespace = p_ns AND expires_at >= now()
$$;

-- Delete the evaluations whose attemptId starts with one of `p_prefixes` and, with
-- `p_namespace`, empty the namespace's indexes and topology; how many rows went.
CREATE FUNCTION eai.purge(p_ns text, p_prefixes text[], p_namespace boolean) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t uuid := eai.tenant();
    n integer;
    total integer := 0;
BEGIN
    DELETE FROM eai.runs r
    WHERE r.tenant_id = t AND r.namespace = p_ns
      AND EXISTS (SELECT 1 FROM unnest(p_prefixes) AS x WHERE starts_with(r.attempt_id, x));
    GET DIAGNOSTICS n = ROW_COUNT;
    total := total + n;
    IF p_namespace THEN
        UPDATE eai.runs SET running_ms = NULL
        WHERE tenant_id = t AND namespace = p_ns AND running_ms IS NOT NULL;
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
        UPDATE eai.checkpoints c SET retry_due_ms = NULL FROM eai.runs r
        WHERE c.run_id = r.id AND r.tenant_id = t AND r.namespace = p_ns
          AND c.retry_due_ms IS NOT NULL;
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
        DELETE FROM eai.topology WHERE tenant_id = t AND namespace = p_ns;
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
    END IF;
    RETURN total;
END $$;

-- Retention: delete up to `p_limit` evaluations (with all that hangs off them) and topology
-- names past their time; how many went.
CREATE FUNCTION eai.purge_expired(p_limit integer) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    t uuid := eai.tenant();
    n integer;
    m integer;
BEGIN
    DELETE FROM eai.runs WHERE id IN (
        SELECT id FROM eai.runs WHERE tenant_id = t AND expires_at < now()
        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM eai.topology WHERE tenant_id = t AND expires_at < now();
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m;
END $$;

-- --- one round trip for a batch -----------------------------------------------------------

-- JSON arrays to SQL arrays, in order.
CREATE FUNCTION eai._texts(j jsonb) RETURNS text[] LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(array_agg(x ORDER BY n), '{}')
    FROM jsonb_array_elements_text(coalesce(j, '[]')) WITH ORDINALITY AS e (x, n)
$$;
CREATE FUNCTION eai._ints(j jsonb) RETURNS integer[] LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(array_agg(x::integer ORDER BY n), '{}')
    FROM jsonb_array_elements_text(coalesce(j, '[]')) WITH ORDINALITY AS e (x, n)
$$;

-- Run a batch of operations, in order, in the caller's transaction (one statement: one
-- round trip, one commit, one WAL flush for the whole batch), for the tenant given (set
-- for this transaction only: a session SET would leak to whoever uses the pooled
-- connection next). Each operation is `[name, attemptId, args...]`; the replies come
-- back as a JSON array, one each, in order. An operation that raises fails the batch,
-- which then wrote nothing (the store runs its operations again one by one).
CREATE FUNCTION eai.apply(p_tenant text, p_ns text, p_lease_ms bigint, p_ttl integer,
                          p_ops jsonb, p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    op jsonb;
    a text;
    reply jsonb;
    replies jsonb[] := '{}';
BEGIN
    PERFORM set_config('app.tenant_id', p_tenant, true);
    FOR op IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        a := op ->> 1;
        CASE op ->> 0
        WHEN 'write_result' THEN
            reply := to_jsonb(eai.write_result(p_ns, a, op ->> 2, op ->> 3, eai._texts(op -> 4),
                eai._ints(op -> 5), op ->> 6, p_lease_ms, p_ttl, p_now));
        WHEN 'write_status' THEN
            reply := to_jsonb(eai.write_status(p_ns, a, op ->> 2, op ->> 3, (op ->> 4)::bigint,
                (op ->> 5)::bigint, op ->> 6, p_lease_ms, p_ttl, p_now));
        WHEN 'mark_started' THEN
            reply := to_jsonb(eai.mark_started(p_ns, a, eai._texts(op -> 2), eai._ints(op -> 3),
                op ->> 4, p_lease_ms, p_ttl, p_now));
        WHEN 'renew' THEN
            reply := to_jsonb(eai.renew(p_ns, a, op ->> 2, op ->> 3, p_lease_ms, p_ttl, p_now));
        WHEN 'begin' THEN
            reply := to_jsonb(eai.begin(p_ns, a, op ->> 2, eai._texts(op -> 3), op ->> 4,
                p_lease_ms, p_ttl, p_now));
        WHEN 'mark_pass_published' THEN
            reply := to_jsonb(eai.mark_pass_published(p_ns, a, op ->> 2, op ->> 3, op ->> 4,
                p_lease_ms, p_ttl, p_now));
        WHEN 'park' THEN
            reply := to_jsonb(eai.park(p_ns, a, op ->> 2, eai._texts(op -> 3), op ->> 4,
                p_lease_ms, p_ttl, p_now));
        WHEN 'finish' THEN
            reply := to_jsonb(eai.finish(p_ns, a, op ->> 2, eai._texts(op -> 3),
                eai._texts(op -> 4), eai._texts(op -> 5), op ->> 6, p_lease_ms, p_ttl, p_now));
        WHEN 'done' THEN
            reply := to_jsonb(eai.done(p_ns, a, op ->> 2, p_ttl, p_now));
        WHEN 'set_state' THEN
            reply := to_jsonb(eai.set_state(p_ns, a, op ->> 2, p_ttl));
        WHEN 'release' THEN
            reply := to_jsonb(eai.release(p_ns, a, op ->> 2, p_ttl, p_now));
        WHEN 'unindex' THEN
            reply := to_jsonb(eai.unindex(p_ns, a, p_ttl));
        WHEN 'claim_stale' THEN
            reply := to_jsonb(eai.claim_stale(p_ns, a, (op ->> 2)::bigint, p_ttl, p_now));
        WHEN 'claim_retry' THEN
            reply := to_jsonb(eai.claim_retry(p_ns, a, op ->> 2, (op ->> 3)::bigint, p_ttl, p_now));
        WHEN 'snapshot' THEN
            reply := eai.snapshot(p_ns, a, eai._texts(op -> 2));
        WHEN 'record' THEN
            reply := to_jsonb(eai.record(p_ns, a));
        WHEN 'stored_plan' THEN
            reply := to_jsonb(eai.stored_plan(p_ns, a));
        WHEN 'holder' THEN
            reply := to_jsonb(eai.holder(p_ns, a, p_now));
        WHEN 'reinstate' THEN
            reply := to_jsonb(eai.reinstate(p_ns, a, op ->> 2, p_ttl));
        WHEN 'stale_evaluations' THEN
            reply := to_jsonb(eai.stale_evaluations(p_ns, (op ->> 2)::bigint,
                (op ->> 3)::integer, p_now));
        WHEN 'overdue_retries' THEN
            reply := to_jsonb(eai.overdue_retries(p_ns, (op ->> 2)::bigint,
                (op ->> 3)::integer, p_now));
        WHEN 'remember_topology' THEN
            reply := to_jsonb(eai.remember_topology(p_ns, eai._texts(op -> 2), p_ttl));
        WHEN 'topology' THEN
            reply := to_jsonb(eai.topology(p_ns));
        WHEN 'purge' THEN
            reply := to_jsonb(eai.purge(p_ns, eai._texts(op -> 2), (op ->> 3)::boolean));
        WHEN 'purge_expired' THEN
            reply := to_jsonb(eai.purge_expired((op ->> 2)::integer));
        ELSE
            RAISE EXCEPTION 'eai.apply: no operation %', op ->> 0 USING ERRCODE = '22023';
        END CASE;
        replies := array_append(replies, reply);
    END LOOP;
    RETURN to_jsonb(replies);
END $$;

-- Only the roles the migration runner grants may run these (`GRANT EXECUTE` per role).
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA eai FROM PUBLIC;
