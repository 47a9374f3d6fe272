-- The outbox of the `pg` design: an event and the store operation that records it as
-- published, in one transaction. The shell publishes `evaluation.completed` and a pass
-- result, then flags them (`done`, `mark_pass_published`); on a broker those are two
-- writes, and a crash between them announces the event again on recovery (consumers
-- dedupe on its id). With the events as rows of the same database, the driver sends the
-- pair as one operation, `["announce", attempt, topic, message_id, data, op]`: the row
-- and the flag land together or not at all, and a flag refused by the fence (a zombie's)
-- writes no event either.

ALTER FUNCTION eai.apply(text, text, bigint, integer, jsonb, bigint) RENAME TO apply_0001;

-- `eai.apply` of the first migration, plus `announce`. A batch without one goes to it as
-- it is (one containment test a batch); a batch with one, an operation at a time.
CREATE FUNCTION eai.apply(p_tenant text, p_ns text, p_lease_ms bigint, p_ttl integer,
                          p_ops jsonb, p_now bigint DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    op jsonb;
    reply jsonb;
    replies jsonb[] := '{}';
BEGIN
    IF NOT p_ops @> '[["announce"]]' THEN
        RETURN eai.apply_0001(p_tenant, p_ns, p_lease_ms, p_ttl, p_ops, p_now);
    END IF;
    FOR op IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        IF op ->> 0 = 'announce' THEN
            reply := eai.apply_0001(p_tenant, p_ns, p_lease_ms, p_ttl,
                                    jsonb_build_array(op -> 5), p_now) -> 0;
            IF NOT (jsonb_typeof(reply) = 'array' AND reply ->> 0 = '!fenced') THEN
                -- An event is never lost to a crash, as `eai.queue_apply`'s are not.
                PERFORM set_config('synchronous_commit', 'on', true);
                PERFORM eai.event_publish(p_ns, op ->> 2, op ->> 3, op -> 4);
            END IF;
        ELSE
            reply := eai.apply_0001(p_tenant, p_ns, p_lease_ms, p_ttl,
                                    jsonb_build_array(op), p_now) -> 0;
        END IF;
        replies := array_append(replies, reply);
    END LOOP;
    RETURN to_jsonb(replies);
END $$;

REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA eai FROM PUBLIC;
