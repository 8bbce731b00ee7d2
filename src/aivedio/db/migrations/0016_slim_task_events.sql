-- task_events keeps only what its readers read (issue 15: at most 300 bytes per event with its
-- indexes; 357 before, at 10 million events). The replay (gateway.store), the task's event
-- list and audit view (queries/tasks.sql) and the retention's floors read project, epoch, seq,
-- task, version, payload, source, trace id and created_at. The rest is the audit's:
-- - tenant_id is the project's (projects.tenant_id);
-- - attempt_id and occurred_at ride the bus event (the outbox payload) and, for an
--   observation that wrote no event, observation_audit (task_attempts keeps every attempt);
-- - event_type was always 'task.status' (the audit view says so without reading a column).
-- The payload is stored as json: the compact text the state service writes (no identity
-- fields, no nulls: state.events.stored_payload), which the replay sends on as it is, where
-- jsonb was about 12 bytes longer and had to be turned back into text on every replay. The
-- trace id is stored as its 12 or 16 bytes (trc_<hex>: aivedio.logs), read back as text.
--
-- Converting a populated database rewrites every partition of task_events (ALTER COLUMN ...
-- TYPE), holding its ACCESS EXCLUSIVE lock meanwhile: writers wait for the migration, as they
-- do for any migration: 5.7 s for 1,000,000 events on the CI machine (a minute at 10 million;
-- the inbox keeps taking callbacks meanwhile, and applies them after). No seq, epoch,
-- cursor or payload field changes; the dropped columns' bytes go with the rewrite. A trace id
-- that is not aivedio's form (none is written) would become NULL.
ALTER TABLE task_events
    DROP COLUMN tenant_id,
    DROP COLUMN attempt_id,
    DROP COLUMN event_type,
    DROP COLUMN occurred_at,
    ALTER COLUMN public_payload TYPE json USING public_payload::json,
    ALTER COLUMN trace_id TYPE bytea USING (
        CASE WHEN trace_id ~ '^trc_([0-9a-f]{2})+$' THEN decode(substr(trace_id, 5), 'hex') END
    );
