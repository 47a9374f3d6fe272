-- The work queue of the `pg` design (PostgreSQL alone, no broker): what RabbitMQ does for
-- the first design, as rows, behind the same shell (engine/runtime/pgqueue.py).
--
--   RabbitMQ                                  here
--   the work queue evaluation.execute         eai.jobs, queue = the work queue's name
--   a delay queue (TTL, dead-lettered back)   a job of the work queue with visible_ms later
--   a delivery held unacknowledged            claimed_by, claim_until_ms (a visibility lease
--                                             the consumer renews; lapsed: redelivered)
--   ACK / NACK with requeue                   the row deleted / made visible again
--   a worker's exclusive queue worker.{id}    jobs with queue = 'worker.{id}', routable while
--                                             the worker's row in eai.consumers is fresh
--   the control fanout                        one job a live consumer (kind 'control')
--   the events exchange                       rows of eai.run_events with a topic (an outbox:
--                                             read in order of seq, at least once, by id)
--   basic.consume's push                      a claim (FOR UPDATE SKIP LOCKED) woken by
--                                             NOTIFY eai_jobs, polling as the fallback
--
-- Times are Unix ms from the database's clock (`eai.now_ms()`), or given (`p_now`), as the
-- store's are. A job whose claimant died comes back when its claim lapses (`deliveries` then
-- counts it: redelivered); a forward to a worker whose consumer row went stale is routed to
-- the work queue by the next claim, where RabbitMQ would have dropped it with the queue.

CREATE TABLE eai.jobs (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    seq bigint GENERATED ALWAYS AS IDENTITY,
    namespace text NOT NULL,
    queue text NOT NULL,          -- the work queue's name, or 'worker.{id}' (a private queue)
    kind text NOT NULL DEFAULT 'work',  -- work | control
    message_id text,
    body bytea NOT NULL,
    visible_ms bigint NOT NULL,   -- claimable from then on (a delayed retry: later)
    claimed_by text,              -- the worker holding it unsettled
    claim_until_ms bigint,        -- ... while this is >= now
    deliveries integer NOT NULL DEFAULT 0  -- claims so far: the claim's token, > 1 redelivered
);
CREATE INDEX jobs_ready ON eai.jobs (tenant_id, namespace, visible_ms, seq);

-- The consumers alive, renewed with their claims: a private queue is routable while its
-- worker's row is fresh (RabbitMQ deletes an exclusive queue with its connection).
CREATE TABLE eai.consumers (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id uuid NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    namespace text NOT NULL,
    worker_id text NOT NULL,
    seen_ms bigint NOT NULL,
    UNIQUE (tenant_id, namespace, worker_id)
);

-- Events announced (evaluation.started, pass results, evaluation.completed) are rows of
-- run_events with a topic, read in `seq` order by any number of consumers.
ALTER TABLE eai.run_events ALTER COLUMN run_id DROP NOT NULL;
ALTER TABLE eai.run_events ADD COLUMN namespace text;
ALTER TABLE eai.run_events ADD COLUMN topic text;
ALTER TABLE eai.run_events ADD COLUMN message_id text;
ALTER TABLE eai.run_events ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;
CREATE INDEX run_events_outbox ON eai.run_events (tenant_id, namespace, seq)
    WHERE topic IS NOT NULL;

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['jobs', 'consumers'] LOOP
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

-- Whether worker `p_worker` consumes (its row renewed within `p_lease_ms`).
CREATE FUNCTION eai._consumes(p_ns text, p_worker text, p_lease_ms bigint, p_now bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM eai.consumers
        WHERE tenant_id = eai.tenant() AND namespace = p_ns AND worker_id = p_worker
          AND seen_ms >= p_now - p_lease_ms
    )
$$;

-- A job in; consumers are woken at commit (NOTIFY is transactional) with when it is due.
CREATE FUNCTION eai.job_publish(p_ns text, p_queue text, p_kind text, p_message_id text,
                                p_body bytea, p_visible_ms bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO eai.jobs (tenant_id, namespace, queue, kind, message_id, body, visible_ms)
    VALUES (eai.tenant(), p_ns, p_queue, p_kind, p_message_id, p_body, p_visible_ms);
    PERFORM pg_notify('eai_jobs', p_ns || ' ' || p_visible_ms);
END $$;

-- Claim for `p_me` up to `p_n` jobs of the work queue and up to `p_n_mine` of its own queue
-- (each its own budget, as RabbitMQ gives each consumer its own credit: a window full of
-- work must not keep a forward or a cancel waiting), visible and unclaimed or whose claim
-- lapsed, oldest first, skipping rows another transaction holds; a forward to a worker
-- that no longer consumes is taken as work, and a control job of one is dropped. A lapsed
-- claim of `p_me`'s own comes back to it too (the client knows the ones it still holds:
-- for those the claim is renewed, not a new delivery). Replies [[id, deliveries,
-- message_id, body (base64), queue], ...] and, last, when the next job not yet visible is
-- due (NULL: none).
CREATE FUNCTION eai.job_claim(p_ns text, p_me text, p_work text, p_n integer, p_n_mine integer,
                              p_lease_ms bigint, p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    t uuid := eai.tenant();
    v_mine text := 'worker.' || p_me;
    v_jobs jsonb;
    v_next bigint;
BEGIN
    DELETE FROM eai.jobs j
    WHERE j.tenant_id = t AND j.namespace = p_ns AND j.kind = 'control' AND j.queue <> v_mine
      AND j.claimed_by IS NULL
      AND NOT eai._consumes(p_ns, substr(j.queue, 8), p_lease_ms, v_now);
    WITH work AS (
        SELECT j.id FROM eai.jobs j
        WHERE j.tenant_id = t AND j.namespace = p_ns AND j.visible_ms <= v_now
          AND (j.claimed_by IS NULL OR j.claim_until_ms < v_now)
          AND (j.queue = p_work
               OR (j.queue <> v_mine AND j.kind = 'work'
                   AND NOT eai._consumes(p_ns, substr(j.queue, 8), p_lease_ms, v_now)))
        ORDER BY j.visible_ms, j.seq
        LIMIT p_n
        FOR UPDATE SKIP LOCKED
    ), mine AS (
        SELECT j.id FROM eai.jobs j
        WHERE j.tenant_id = t AND j.namespace = p_ns AND j.visible_ms <= v_now
          AND (j.claimed_by IS NULL OR j.claim_until_ms < v_now) AND j.queue = v_mine
        ORDER BY j.visible_ms, j.seq
        LIMIT p_n_mine
        FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE eai.jobs j SET claimed_by = p_me, claim_until_ms = v_now + p_lease_ms,
            deliveries = j.deliveries + 1, updated_at = now()
        WHERE j.id IN (SELECT id FROM work UNION ALL SELECT id FROM mine)
        RETURNING j.id, j.deliveries, j.message_id, j.body, j.queue, j.visible_ms, j.seq
    )
    SELECT coalesce(jsonb_agg(jsonb_build_array(c.id, c.deliveries, c.message_id,
                                                encode(c.body, 'base64'), c.queue)
                              ORDER BY c.visible_ms, c.seq), '[]')
    INTO v_jobs FROM claimed c;
    SELECT min(j.visible_ms) INTO v_next FROM eai.jobs j
    WHERE j.tenant_id = t AND j.namespace = p_ns AND j.visible_ms > v_now
      AND (j.queue = p_work OR j.queue = v_mine);
    RETURN v_jobs || jsonb_build_array(v_next);
END $$;

-- ACK: the job is gone, if this claim (`p_token`, its deliveries) still holds it.
CREATE FUNCTION eai.job_ack(p_ns text, p_id uuid, p_me text, p_token integer)
RETURNS boolean LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM eai.jobs WHERE tenant_id = eai.tenant() AND namespace = p_ns AND id = p_id
          AND claimed_by = p_me AND deliveries = p_token
        RETURNING 1
    ) SELECT EXISTS (SELECT 1 FROM gone)
$$;

-- NACK with requeue: visible again at once, for any consumer.
CREATE FUNCTION eai.job_nack(p_ns text, p_id uuid, p_me text, p_token integer,
                             p_now bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
BEGIN
    UPDATE eai.jobs SET claimed_by = NULL, claim_until_ms = NULL, visible_ms = v_now,
        updated_at = now()
    WHERE tenant_id = eai.tenant() AND namespace = p_ns AND id = p_id
      AND claimed_by = p_me AND deliveries = p_token;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('eai_jobs', p_ns || ' ' || v_now);
    RETURN true;
END $$;

-- The consumer's heartbeat: its row renewed and the claims it still holds extended; the
-- ids of those it holds no more (lapsed and taken by another: a lost delivery).
CREATE FUNCTION eai.job_renew(p_ns text, p_me text, p_ids uuid[], p_lease_ms bigint,
                              p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    v_kept uuid[];
BEGIN
    INSERT INTO eai.consumers (tenant_id, namespace, worker_id, seen_ms)
    VALUES (eai.tenant(), p_ns, p_me, v_now)
    ON CONFLICT (tenant_id, namespace, worker_id)
    DO UPDATE SET seen_ms = excluded.seen_ms, updated_at = now();
    WITH kept AS (
        UPDATE eai.jobs SET claim_until_ms = v_now + p_lease_ms
        WHERE tenant_id = eai.tenant() AND namespace = p_ns AND id = ANY(p_ids)
          AND claimed_by = p_me
        RETURNING id
    ) SELECT coalesce(array_agg(id), '{}') INTO v_kept FROM kept;
    RETURN coalesce((SELECT jsonb_agg(i) FROM unnest(p_ids) i WHERE i <> ALL(v_kept)), '[]');
END $$;

-- A consumer that stops: its queue is unroutable from now on.
CREATE FUNCTION eai.job_deregister(p_ns text, p_me text) RETURNS void LANGUAGE sql AS $$
    DELETE FROM eai.consumers
    WHERE tenant_id = eai.tenant() AND namespace = p_ns AND worker_id = p_me
$$;

-- A forward to the worker holding the evaluation; false (unroutable) when it does not
-- consume: the caller puts the message back, as with a RabbitMQ queue gone.
CREATE FUNCTION eai.job_forward(p_ns text, p_worker text, p_message_id text, p_body bytea,
                                p_lease_ms bigint, p_now bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
BEGIN
    IF NOT eai._consumes(p_ns, p_worker, p_lease_ms, v_now) THEN
        RETURN false;
    END IF;
    PERFORM eai.job_publish(p_ns, 'worker.' || p_worker, 'work', p_message_id, p_body, v_now);
    RETURN true;
END $$;

-- The control fanout: a job for each consumer alive; how many.
CREATE FUNCTION eai.job_control(p_ns text, p_body bytea, p_lease_ms bigint,
                                p_now bigint DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := coalesce(p_now, eai.now_ms());
    n integer;
BEGIN
    INSERT INTO eai.jobs (tenant_id, namespace, queue, kind, body, visible_ms)
    SELECT c.tenant_id, p_ns, 'worker.' || c.worker_id, 'control', p_body, v_now
    FROM eai.consumers c
    WHERE c.tenant_id = eai.tenant() AND c.namespace = p_ns AND c.seen_ms >= v_now - p_lease_ms;
    GET DIAGNOSTICS n = ROW_COUNT;
    PERFORM pg_notify('eai_jobs', p_ns || ' ' || v_now);
    RETURN n;
END $$;

-- An event into the outbox, with the run it is about when there is one; listeners of
-- eai_events are woken at commit. The namespace's events are numbered under a lock held to
-- the commit, so that they commit in the order of `seq`: a reader that has seen seq n has
-- seen every event before it (without the lock a later seq could commit first, and a
-- reader past it would never see the earlier one).
CREATE FUNCTION eai.event_publish(p_ns text, p_topic text, p_message_id text, p_data jsonb)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('eai.run_events'), hashtext(p_ns));
    INSERT INTO eai.run_events (tenant_id, run_id, kind, namespace, topic, message_id, data)
    VALUES (eai.tenant(), eai._peek(p_ns, p_data ->> 'attempt_id'), 'event', p_ns, p_topic,
            p_message_id, p_data);
    PERFORM pg_notify('eai_events', p_ns);
END $$;

-- Events of the namespace after `p_after` (a seq), in order: [[seq, topic, message_id,
-- data], ...]; `p_topic` a LIKE pattern.
CREATE FUNCTION eai.events_after(p_ns text, p_after bigint, p_topic text, p_limit integer)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_agg(jsonb_build_array(e.seq, e.topic, e.message_id, e.data)
                              ORDER BY e.seq), '[]')
    FROM (
        SELECT seq, topic, message_id, data FROM eai.run_events
        WHERE tenant_id = eai.tenant() AND namespace = p_ns AND topic LIKE p_topic
          AND seq > p_after
        ORDER BY seq LIMIT p_limit
    ) e
$$;

-- The queue's operations in one transaction for the tenant given, as `eai.apply` takes
-- the store's: `[name, args...]` each, the replies as a JSON array in order.
CREATE FUNCTION eai.queue_apply(p_tenant text, p_ns text, p_lease_ms bigint, p_ops jsonb,
                                p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    op jsonb;
    reply jsonb;
    replies jsonb[] := '{}';
    v_now bigint := coalesce(p_now, eai.now_ms());
BEGIN
    PERFORM set_config('app.tenant_id', p_tenant, true);
    -- Jobs and events are never lost to a crash, whatever the role's synchronous_commit
    -- (which may trade the store's last commits for speed): this commit waits for its WAL.
    PERFORM set_config('synchronous_commit', 'on', true);
    FOR op IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        CASE op ->> 0
        WHEN 'publish' THEN
            PERFORM eai.job_publish(p_ns, op ->> 1, 'work', op ->> 2, decode(op ->> 3, 'base64'),
                v_now + (op ->> 4)::bigint);
            reply := 'true';
        WHEN 'claim' THEN
            reply := eai.job_claim(p_ns, op ->> 1, op ->> 2, (op ->> 3)::integer,
                (op ->> 4)::integer, p_lease_ms, v_now);
        WHEN 'ack' THEN
            reply := to_jsonb(eai.job_ack(p_ns, (op ->> 1)::uuid, op ->> 2, (op ->> 3)::integer));
        WHEN 'nack' THEN
            reply := to_jsonb(eai.job_nack(p_ns, (op ->> 1)::uuid, op ->> 2, (op ->> 3)::integer,
                v_now));
        WHEN 'renew' THEN
            reply := eai.job_renew(p_ns, op ->> 1,
                ARRAY(SELECT jsonb_array_elements_text(op -> 2))::uuid[], p_lease_ms, v_now);
        WHEN 'deregister' THEN
            PERFORM eai.job_deregister(p_ns, op ->> 1);
            reply := 'true';
        WHEN 'forward' THEN
            reply := to_jsonb(eai.job_forward(p_ns, op ->> 1, op ->> 2, decode(op ->> 3, 'base64'),
                p_lease_ms, v_now));
        WHEN 'control' THEN
            reply := to_jsonb(eai.job_control(p_ns, decode(op ->> 1, 'base64'), p_lease_ms, v_now));
        WHEN 'event' THEN
            PERFORM eai.event_publish(p_ns, op ->> 1, op ->> 2, op -> 3);
            reply := 'true';
        WHEN 'events_after' THEN
            reply := eai.events_after(p_ns, (op ->> 1)::bigint, op ->> 2, (op ->> 3)::integer);
        WHEN 'purge_jobs' THEN
            DELETE FROM eai.jobs WHERE tenant_id = eai.tenant() AND namespace = p_ns;
            DELETE FROM eai.consumers WHERE tenant_id = eai.tenant() AND namespace = p_ns;
            reply := 'true';
        ELSE
            RAISE EXCEPTION 'eai.queue_apply: no operation %', op ->> 0 USING ERRCODE = '22023';
        END CASE;
        replies := array_append(replies, reply);
    END LOOP;
    RETURN to_jsonb(replies);
END $$;

REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA eai FROM PUBLIC;
