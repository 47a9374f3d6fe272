-- The store's hot path made cheaper inside PostgreSQL: the same operations, the same
-- replies, the same rows. Measured with `bench/store_replay.py --against` (one benchmark
-- round's `eai.apply` batches replayed on each schema): about 0.67x the time PostgreSQL
-- spends executing an operation, against migration 0005's schema. Where the time went:
-- each operation's SQL-language helpers ran through the SQL-function executor (planned
-- anew in every transaction), each checkpoint and run step inserted ran a foreign key's
-- check (a query of its own), no write of a run's row was heap-only (each added an entry
-- to every index of `eai.runs`, which the next lookup of that run walked past), two
-- statements were planned again at every call, and a trigger switched users at each
-- checkpoint.

-- 1. The foreign keys to `eai.runs` go; what they did is kept by one statement-level
-- trigger: the rows hanging off a deleted run are deleted with it (expiry in `eai._run`,
-- `eai.purge`, `eai.purge_expired`), as ON DELETE CASCADE did. Nothing is lost by not
-- checking on insert: every writer takes `run_id` from the run's row it holds locked.
-- SECURITY DEFINER, as a foreign key's actions are: the owner's rights, not the caller's.
ALTER TABLE eai.checkpoints DROP CONSTRAINT checkpoints_run_id_fkey;
ALTER TABLE eai.run_steps DROP CONSTRAINT run_steps_run_id_fkey;
ALTER TABLE eai.run_events DROP CONSTRAINT run_events_run_id_fkey;

CREATE FUNCTION eai._cascade() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, eai
AS $$
BEGIN
    DELETE FROM eai.checkpoints WHERE run_id IN (SELECT id FROM gone);
    DELETE FROM eai.run_steps WHERE run_id IN (SELECT id FROM gone);
    DELETE FROM eai.run_events WHERE run_id IN (SELECT id FROM gone);
    RETURN NULL;
END $$;
CREATE TRIGGER runs_cascade AFTER DELETE ON eai.runs REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION eai._cascade();

-- 2. JSON arrays to SQL arrays without the SQL-function executor: most are empty or hold
-- one element (a rule made ready).
CREATE OR REPLACE FUNCTION eai._texts(j jsonb) RETURNS text[] LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    CASE coalesce(jsonb_array_length(j), 0)
    WHEN 0 THEN RETURN '{}';
    WHEN 1 THEN RETURN ARRAY[j ->> 0];
    ELSE RETURN ARRAY(SELECT x FROM jsonb_array_elements_text(j) WITH ORDINALITY AS e (x, n)
                      ORDER BY n);
    END CASE;
END $$;
CREATE OR REPLACE FUNCTION eai._ints(j jsonb) RETURNS integer[] LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    CASE coalesce(jsonb_array_length(j), 0)
    WHEN 0 THEN RETURN '{}';
    WHEN 1 THEN RETURN ARRAY[(j ->> 0)::integer];
    ELSE RETURN ARRAY(SELECT x::integer FROM jsonb_array_elements_text(j) WITH ORDINALITY
                      AS e (x, n) ORDER BY n);
    END CASE;
END $$;

-- 3. A run's writes heap-only. Every write moves `expires_at` (the retention runs from
-- the last write), so the retention sweep's index is on `expires_hour`, the hour it falls
-- in, which the writers (`_run`, `_save`) set with it and which changes once an hour at
-- most; the table leaves room on each page for a row's new versions. `eai.purge_expired`
-- takes the runs whose hour has come through that index and, of those, the ones past
-- `expires_at`: the retention is as exact as before. (A generated column would keep the
-- two in step by itself, but PostgreSQL rebuilds its expression for every UPDATE
-- statement: 0.89x the time an operation without it.)
CREATE FUNCTION eai._hour(t timestamptz) RETURNS bigint LANGUAGE sql IMMUTABLE
    RETURN floor(extract(epoch FROM t AT TIME ZONE 'UTC') / 3600)::bigint;
DROP INDEX eai.runs_expiry;
ALTER TABLE eai.runs ADD COLUMN expires_hour bigint;
UPDATE eai.runs SET expires_hour = eai._hour(expires_at);
ALTER TABLE eai.runs ALTER COLUMN expires_hour SET NOT NULL;
CREATE INDEX runs_expiry ON eai.runs (tenant_id, expires_hour);
ALTER TABLE eai.runs SET (fillfactor = 70);

-- The two writers of `eai.runs`, as migration 0001 has them, setting `expires_hour` too.
CREATE OR REPLACE FUNCTION eai._run(p_ns text, p_attempt text, p_create boolean, p_ttl integer)
RETURNS eai.run_head LANGUAGE plpgsql AS $$
DECLARE
    t uuid := eai.tenant();
    r eai.run_head;
    v_expires timestamptz;
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
        v_expires := now() + make_interval(secs => p_ttl);
        INSERT INTO eai.runs (tenant_id, namespace, attempt_id, expires_at, expires_hour)
        VALUES (t, p_ns, p_attempt, v_expires, eai._hour(v_expires))
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

CREATE OR REPLACE FUNCTION eai._save(r0 eai.run_head, r eai.run_head, p_ttl integer,
                          p_touched boolean DEFAULT false, p_plan text DEFAULT NULL)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_expires timestamptz := now() + make_interval(secs => p_ttl);
    v_hour bigint := eai._hour(v_expires);
BEGIN
    IF r.id IS NULL OR (r IS NOT DISTINCT FROM r0 AND (NOT p_touched OR r.expires_at = v_expires))
    THEN
        RETURN;
    END IF;
    UPDATE eai.runs SET
        state = r.state, owner = r.owner, lease_until_ms = r.lease_until_ms, fence = r.fence,
        final_published = r.final_published, passes = r.passes, running_ms = r.running_ms,
        updated_at = now(), expires_at = v_expires, expires_hour = v_hour
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

CREATE OR REPLACE FUNCTION eai.purge_expired(p_limit integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t uuid := eai.tenant();
    n integer;
    m integer;
BEGIN
    DELETE FROM eai.runs WHERE id IN (
        SELECT id FROM eai.runs
        WHERE tenant_id = t
          AND expires_hour <= eai._hour(now())  -- the runs whose hour has come
          AND expires_at < now()
        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM eai.topology WHERE tenant_id = t AND expires_at < now();
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m;
END $$;

-- 4. Two statements that were planned again at every call. `eai.finish` looks for the
-- rules to mark permanently failed only when there are some: for an empty array, a plan
-- made for its values looked so much cheaper than the generic one that PostgreSQL planned
-- the statement anew each time. `eai.record` reads the run in PL/pgSQL, whose plans are
-- kept, rather than as a SQL function calling `eai._peek`, planned again at every call.
CREATE OR REPLACE FUNCTION eai.record(p_ns text, p_attempt text) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    out text[];
BEGIN
    SELECT ARRAY[r.state, r.plan, CASE WHEN r.final_published THEN '1' ELSE '' END] INTO out
    FROM eai.runs r
    WHERE r.tenant_id = eai.tenant() AND r.namespace = p_ns AND r.attempt_id = p_attempt
      AND r.expires_at >= now();
    RETURN coalesce(out, ARRAY[NULL, NULL, '']);
END $$;

CREATE OR REPLACE FUNCTION eai.finish(p_ns text, p_attempt text, p_status text, p_result_rules text[],
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
    v_failed := '{}';
    IF cardinality(p_failed) > 0 THEN
        SELECT coalesce(array_agg(f.rule_id ORDER BY f.n), '{}') INTO v_failed
        FROM unnest(p_failed) WITH ORDINALITY AS f (rule_id, n)
        LEFT JOIN eai.checkpoints c ON c.run_id = r.id AND c.rule_id = f.rule_id
        WHERE c.status IS DISTINCT FROM 'permanently_failed';
    END IF;
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

-- 5. A result's number (migration 0003) taken by a trigger that runs as the caller: as
-- SECURITY DEFINER with its own search_path, each checkpoint inserted paid for switching
-- the user and the settings in and out (0.95x the time an operation without). The
-- engine's roles get USAGE on the sequence instead (`migrate` grants it), which lets them
-- take numbers, nothing more than writing the column they could already.
ALTER FUNCTION eai._number_checkpoint() SECURITY INVOKER RESET search_path;

REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA eai FROM PUBLIC;
