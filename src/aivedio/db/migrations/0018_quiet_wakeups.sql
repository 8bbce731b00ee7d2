-- Writers whose consumer is woken in memory send no NOTIFY (issue 11). With two `--role all`
-- processes at 100 webhooks/s, `bench e2e` counted 35 statements per webhook, 8 of them the
-- work: every notification woke every sleeping consumer of the table, in both processes, and
-- each one then claimed nothing (the rows were another's) and fell asleep again (the idle
-- lock taken and released, a re-check): 4.2 idle-lock waits and 2 empty inbox claims and 2.5
-- empty outbox claims per webhook. aivedio/db/wakeup.py has the protocol.

-- The inbox: rows stored leased are handed to the inbox processor of the writer's process in
-- memory (aivedio.db.handoff); no other processor may claim them before the lease ends, which
-- the processors' poll then finds. So only a statement that stored an unleased row notifies.
CREATE OR REPLACE FUNCTION aivedio_inbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows WHERE lease_token IS NULL)
       AND NOT pg_try_advisory_xact_lock_shared(1229865560) THEN
        PERFORM pg_notify('aivedio_inbox', '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER trg_inbox_notify ON provider_callback_inbox;
CREATE TRIGGER trg_inbox_notify AFTER INSERT ON provider_callback_inbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_inbox_notify();

-- The outbox: the inbox processor of a process that runs an outbox relay kicks that relay after
-- its commit (aivedio.db.wakeup.Signal) and marks its transaction so
-- (set_config('aivedio.relay_kicked', 'on', true), queries/inbox.sql inbox_take_claimed). A
-- writer that does not (the API, the poller, a processor without a relay beside it) notifies
-- as before (migration 0003).
CREATE OR REPLACE FUNCTION aivedio_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('aivedio.relay_kicked', true) IS DISTINCT FROM 'on'
       AND NOT pg_try_advisory_xact_lock_shared(1330992194) THEN
        PERFORM pg_notify('aivedio_outbox', '');
    END IF;
    RETURN NULL;
END
$$;
