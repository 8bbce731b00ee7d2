-- Outbox relay (issue 6): a task's older pending rows are found by index, and an insert wakes an
-- idle relay through LISTEN/NOTIFY, but only when a relay is idle.
--
-- Why the advisory lock: NOTIFY takes a cluster-wide lock at commit that serialises every
-- committing transaction that notified (WAL flush included); measured with `aivedio bench
-- transitions` it cut applied observations/s by about half. So a relay that is about to sleep
-- takes advisory lock 1330992194 exclusively (session level) and sleeps on LISTEN. A writer's
-- trigger tries to take it shared for its transaction: if that fails, a relay sleeps (or is
-- about to) and the writer notifies; if it succeeds, no relay sleeps, nothing is sent, and the
-- shared lock held until commit keeps a relay from falling asleep before this row is visible
-- (the relay re-checks for work after it got the lock). docs/explanation/propagation.md.
CREATE INDEX idx_outbox_pending_aggregate ON outbox_events (aggregate_id, id)
    WHERE publish_status = 'pending';

CREATE FUNCTION aivedio_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1330992194) THEN
        PERFORM pg_notify('aivedio_outbox', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER trg_outbox_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_outbox_notify();
