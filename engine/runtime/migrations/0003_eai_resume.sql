-- Resume from a checkpoint, as the durable design has it (`AgentLoop.resume(run_id)`,
-- `POST /v1/runs/{id}/resume` with `from_checkpoint`): a run's checkpoints are numbered in
-- the order their results became durable (chk_0001, chk_0002, ...), and a resume keeps
-- everything up to the checkpoint named (by default the last) and trusts nothing after it.

-- `number` orders a run's results by when they landed (one sequence for all runs); a
-- run's checkpoint n is its n-th in that order (`row_number()`), so numbering costs one
-- `nextval`, not a look at the run's other checkpoints (thousands in one batch).
CREATE SEQUENCE eai.checkpoint_order;
ALTER TABLE eai.checkpoints ADD COLUMN number bigint;
ALTER TABLE eai.runs ADD COLUMN resumes integer NOT NULL DEFAULT 0;

-- A result landing (inserted, or written into a row that had only a status) takes the next
-- value of the sequence. Every writer holds the run's row lock (`eai._run`), so one run's
-- results are numbered one at a time, in commit order. SECURITY DEFINER: the engine's role
-- needs no right on the sequence.
CREATE FUNCTION eai._number_checkpoint() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, eai
AS $$
BEGIN
    IF NEW.result IS NOT NULL AND NEW.number IS NULL
       AND (TG_OP = 'INSERT' OR OLD.result IS NULL) THEN
        NEW.number := nextval('eai.checkpoint_order');
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER checkpoints_number BEFORE INSERT OR UPDATE OF result ON eai.checkpoints
    FOR EACH ROW EXECUTE FUNCTION eai._number_checkpoint();

-- Resume run `p_attempt` from checkpoint `p_number` (NULL: its last). Kept: the results
-- numbered up to it, with their statuses and start counts. Not trusted, so deleted: every
-- other checkpoint (later results, statuses and retries of rules without a kept result),
-- and the passes announced when anything was deleted (they are announced again). The
-- lease is taken from whoever holds it: the fence moves on to `n:resume`, so that a live
-- owner's next write is refused and it lets the run go; the run stays in the running index.
-- Replies {'ok', checkpoint number (0: none yet), attempt, rules deleted...} or
-- {'unknown'} / {'terminal', state} / {'nocheckpoint', last number}.
CREATE FUNCTION eai.resume(p_ns text, p_attempt text, p_number integer, p_reason text,
                           p_ttl integer, p_now bigint DEFAULT NULL)
RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    r eai.run_head := eai._run(p_ns, p_attempt, false, p_ttl);
    r0 eai.run_head := r;
    v_last integer;
    v_from integer;
    v_gone text[];
    v_attempt integer;
BEGIN
    IF r.id IS NULL OR NOT r.has_plan THEN
        RETURN ARRAY['unknown'];
    END IF;
    IF eai.terminal(r.state) THEN
        RETURN ARRAY['terminal', r.state];
    END IF;
    SELECT count(*) INTO v_last FROM eai.checkpoints c
    WHERE c.run_id = r.id AND c.number IS NOT NULL;
    IF p_number IS NOT NULL AND (p_number < 1 OR p_number > v_last) THEN
        RETURN ARRAY['nocheckpoint', v_last::text];
    END IF;
    v_from := coalesce(p_number, v_last);
    WITH ranked AS (
        SELECT c.id, row_number() OVER (ORDER BY c.number) AS n FROM eai.checkpoints c
        WHERE c.run_id = r.id AND c.number IS NOT NULL
    ), gone AS (
        DELETE FROM eai.checkpoints c
        WHERE c.run_id = r.id AND (c.number IS NULL OR c.id IN (SELECT id FROM ranked WHERE n > v_from))
        RETURNING c.rule_id
    ) SELECT coalesce(array_agg(rule_id ORDER BY rule_id COLLATE "C"), '{}') INTO v_gone FROM gone;
    IF cardinality(v_gone) > 0 THEN
        r.passes := '{}';
    END IF;
    UPDATE eai.runs SET resumes = resumes + 1 WHERE id = r.id RETURNING resumes + 1 INTO v_attempt;
    r.owner := NULL;
    r.lease_until_ms := NULL;
    r.fence := (coalesce(substring(r.fence FROM '^([0-9]+):')::bigint, 0) + 1)::text || ':resume';
    r.state := 'running';
    r.running_ms := v_now;
    PERFORM eai._save(r0, r, p_ttl, true);
    INSERT INTO eai.run_events (tenant_id, run_id, kind, data)
    VALUES (r.tenant_id, r.id, 'run.resume',
            jsonb_build_object('checkpoint', v_from, 'attempt', v_attempt, 'reason', p_reason,
                               'deleted', to_jsonb(v_gone)));
    RETURN ARRAY['ok', v_from::text, v_attempt::text] || v_gone;
END $$;

-- The run's checkpoints in order: [[number, rule_id], ...] (a resume names one of them).
CREATE FUNCTION eai.checkpoint_list(p_ns text, p_attempt text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_agg(jsonb_build_array(s.n, s.rule_id) ORDER BY s.n), '[]')
    FROM (
        SELECT row_number() OVER (ORDER BY c.number) AS n, c.rule_id FROM eai.checkpoints c
        WHERE c.run_id = eai._peek(p_ns, p_attempt) AND c.number IS NOT NULL
    ) s
$$;

-- The runs whose owner stopped renewing: in the running index for longer than
-- `p_older_than_ms` and held by nobody now (`GET /v1/heartbeats`, `engine.submit
-- --heartbeats`): [[attemptId, owner, ms since its last stamp], ...].
CREATE FUNCTION eai.stale_heartbeats(p_ns text, p_older_than_ms bigint, p_limit integer,
                                     p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_agg(jsonb_build_array(s.attempt_id, s.owner, s.age)
                              ORDER BY s.age DESC, s.attempt_id COLLATE "C"), '[]')
    FROM (
        SELECT attempt_id, owner, coalesce(p_now, eai.now_ms()) - running_ms AS age
        FROM eai.runs
        WHERE tenant_id = eai.tenant() AND namespace = p_ns AND expires_at >= now()
          AND running_ms <= coalesce(p_now, eai.now_ms()) - p_older_than_ms
          AND NOT eai.terminal(state)
          AND coalesce(lease_until_ms, 0) < coalesce(p_now, eai.now_ms())
        ORDER BY age DESC LIMIT p_limit
    ) s
$$;

-- `eai.apply` with the operations of this migration too; the earlier ones unchanged.
CREATE FUNCTION eai.apply_more(p_tenant text, p_ns text, p_lease_ms bigint, p_ttl integer,
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
        WHEN 'resume' THEN
            reply := to_jsonb(eai.resume(p_ns, a, (op ->> 2)::integer, op ->> 3, p_ttl, p_now));
        WHEN 'checkpoints' THEN
            reply := eai.checkpoint_list(p_ns, a);
        WHEN 'stale_heartbeats' THEN
            reply := eai.stale_heartbeats(p_ns, (op ->> 2)::bigint, (op ->> 3)::integer, p_now);
        ELSE
            RAISE EXCEPTION 'eai.apply_more: no operation %', op ->> 0 USING ERRCODE = '22023';
        END CASE;
        replies := array_append(replies, reply);
    END LOOP;
    RETURN to_jsonb(replies);
END $$;

REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA eai FROM PUBLIC;
