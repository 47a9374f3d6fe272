-- The outbox, each event with the change it announces. Migration 0004 wrote an event with
-- the operation that flags it published (`done`, `mark_pass_published`); here `begin`
-- writes `evaluation.started`, and the final state (`finish`, a cancel's `set_state`)
-- writes `evaluation.completed`, each in its own transaction and only if the operation
-- took effect (`eai._took_effect`): a begin that took the lease, a final state that won,
-- a write the fence let through. A final state's row also flags the run announced (no
-- recovery announces it again); begin's row gets `resumed` from what its snapshot holds.

-- Whether `p_reply`, an operation's reply in `eai.apply`'s array, says it took effect.
CREATE FUNCTION eai._took_effect(p_op text, p_reply jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN jsonb_typeof(p_reply) = 'array' AND p_reply ->> 0 = '!fenced' THEN false
        WHEN p_op = 'begin' THEN p_reply ->> 0 = 'ok'
        WHEN p_op = 'finish' THEN p_reply ->> 0 = ''
        WHEN p_op = 'set_state' THEN p_reply IS NULL OR jsonb_typeof(p_reply) = 'null'
        ELSE true
    END
$$;

-- Whether begin's reply (`ok`, plan, fence, n passes, the passes, results, statuses) holds
-- a result or a status: the evaluation is resumed (`Snapshot.empty`, negated).
CREATE FUNCTION eai._resumed(p_reply jsonb) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM jsonb_array_elements(p_reply) WITH ORDINALITY AS e (v, n)
        WHERE e.n > 4 + (p_reply ->> 3)::integer AND jsonb_typeof(e.v) <> 'null'
    )
$$;

-- The final state's announcement is written: flag it, as `done` does.
CREATE FUNCTION eai._flag_announced(p_ns text, p_attempt text, p_ttl integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r eai.run_head := eai._run(p_ns, p_attempt, false, p_ttl);
    r0 eai.run_head := r;
BEGIN
    r.final_published := true;
    PERFORM eai._save(r0, r, p_ttl, true);
END $$;

-- `eai.apply` of migration 0004, its `announce` judged by `eai._took_effect`. The batch's
-- operations go to `eai.apply_0001` together, in order, cut only after a final state that
-- announces itself (its flag is written before whatever follows it); the events are
-- written after the operations, since `eai.event_publish` numbers them under a lock held
-- to the commit: the batch takes it for its last statements only.
CREATE OR REPLACE FUNCTION eai.apply(p_tenant text, p_ns text, p_lease_ms bigint, p_ttl integer,
                                     p_ops jsonb, p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    op jsonb;
    v_op jsonb;
    v_data jsonb;
    reply jsonb;
    n integer := 0;
    v_from integer := 0;  -- the first operation of the segment not yet applied
    v_last integer := jsonb_array_length(p_ops) - 1;
    v_seg jsonb := '[]';
    replies jsonb := '[]';
    events jsonb[] := '{}';
    e jsonb;
BEGIN
    IF NOT p_ops @> '[["announce"]]' THEN
        RETURN eai.apply_0001(p_tenant, p_ns, p_lease_ms, p_ttl, p_ops, p_now);
    END IF;
    FOR op IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        v_op := CASE WHEN op ->> 0 = 'announce' THEN op -> 5 ELSE op END;
        v_seg := v_seg || jsonb_build_array(v_op);
        IF n = v_last OR (op ->> 0 = 'announce' AND v_op ->> 0 IN ('finish', 'set_state')) THEN
            replies := replies || eai.apply_0001(p_tenant, p_ns, p_lease_ms, p_ttl, v_seg, p_now);
            FOR i IN v_from .. n LOOP
                op := p_ops -> i;
                CONTINUE WHEN op ->> 0 <> 'announce';
                v_op := op -> 5;
                reply := replies -> i;
                IF eai._took_effect(v_op ->> 0, reply) THEN
                    v_data := op -> 4;
                    IF v_op ->> 0 = 'begin' THEN
                        v_data := jsonb_set(v_data, '{resumed}', to_jsonb(eai._resumed(reply)));
                    ELSIF v_op ->> 0 IN ('finish', 'set_state') THEN
                        PERFORM eai._flag_announced(p_ns, op ->> 1, p_ttl);
                    END IF;
                    events := array_append(events, jsonb_build_array(op ->> 2, op ->> 3, v_data));
                END IF;
            END LOOP;
            v_seg := '[]';
            v_from := n + 1;
        END IF;
        n := n + 1;
    END LOOP;
    IF cardinality(events) > 0 THEN
        -- An event is never lost to a crash, as `eai.queue_apply`'s are not.
        PERFORM set_config('synchronous_commit', 'on', true);
        FOREACH e IN ARRAY events LOOP
            PERFORM eai.event_publish(p_ns, e ->> 0, e ->> 1, e -> 2);
        END LOOP;
    END IF;
    RETURN replies;
END $$;

REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA eai FROM PUBLIC;
