-- Wake an idle inbox processor within a millisecond of a stored callback (issue 11): the
-- callbacks' group commit inserts a batch per statement, and this trigger notifies
-- `aivedio_inbox` once per statement, but only while a processor sleeps holding advisory lock
-- 1229865560 ("INBX"); the same protocol as the outbox relay's (migration 0003,
-- aivedio/db/wakeup.py). The processor's re-check before it sleeps is the claim's own predicate.
CREATE FUNCTION aivedio_inbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1229865560) THEN
        PERFORM pg_notify('aivedio_inbox', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER trg_inbox_notify AFTER INSERT ON provider_callback_inbox
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_inbox_notify();
