-- task_events partitioned by time (issue 15): one partition per UTC day, created ahead by the
-- maintenance role, dropped after AIVEDIO_EVENT_RETENTION once every stream's floor was raised
-- past the seqs it holds (aivedio.retention; docs/explanation/retention.md).
--
-- Converting a populated database copies no row: the old table becomes the partition
-- task_events_legacy, covering everything before tomorrow (UTC), and is dropped by retention
-- like any other partition once its newest possible row is older than the retention. No seq,
-- epoch or cursor changes. The attach builds the new primary key index and scans the table once
-- to check the bound; writers wait for this migration (it holds the table's lock).
--
-- Keys: PostgreSQL wants the partition key in every unique index, so the primary key is
-- (project_id, epoch, seq, created_at). (project_id, epoch, seq) stays unique by construction:
-- the only writers (write_event, write_events) take seq = head + 1 under the stream row's lock.
-- (task_id, task_version) is an ordinary index for the task's audit view; the task row's
-- version CAS keeps it unique.
--
-- No foreign keys: detaching or dropping a partition that has one locks generation_tasks and
-- projects (the referenced side's triggers are created and dropped), which would block every
-- writer; events are only written in the transaction that moves their task, so they always
-- reference a task and a project.
--
-- No default partition: DETACH PARTITION ... CONCURRENTLY (which blocks no writer) refuses to
-- run on a table that has one. The migration creates today and AHEAD days; the maintenance role
-- keeps that many days ahead.

ALTER TABLE task_events RENAME TO task_events_legacy;
ALTER TABLE task_events_legacy DROP CONSTRAINT pk_task_events;
ALTER TABLE task_events_legacy DROP CONSTRAINT uq_task_version;
ALTER TABLE task_events_legacy DROP CONSTRAINT task_events_project_id_fkey;
ALTER TABLE task_events_legacy DROP CONSTRAINT task_events_task_id_fkey;

CREATE TABLE task_events (
    project_id      UUID        NOT NULL,
    epoch           BIGINT      NOT NULL,
    seq             BIGINT      NOT NULL,
    tenant_id       UUID        NOT NULL,
    task_id         UUID        NOT NULL,
    attempt_id      UUID,
    task_version    BIGINT      NOT NULL,
    event_type      TEXT        NOT NULL,
    public_payload  JSONB       NOT NULL,
    source          TEXT        NOT NULL,
    trace_id        TEXT,
    occurred_at     TIMESTAMPTZ,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT pk_task_events PRIMARY KEY (project_id, epoch, seq, created_at)
) PARTITION BY RANGE (created_at);

CREATE INDEX idx_task_events_task ON task_events (task_id, task_version);

-- Creates the daily partitions [day, day + 1) (UTC) from today through today + ahead_days that
-- do not exist yet; returns how many it created. A day that overlaps an existing partition (the
-- legacy one) is skipped. CREATE TABLE + ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE on
-- task_events, which blocks no writer and no reader (CREATE TABLE ... PARTITION OF would take
-- ACCESS EXCLUSIVE).
CREATE FUNCTION aivedio_ensure_event_partitions(ahead_days integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    part text;
    made integer := 0;
BEGIN
    FOR offset_days IN 0 .. ahead_days LOOP
        day := today + offset_days;
        part := 'task_events_p' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
            WHERE i.inhparent = 'task_events'::regclass AND c.relname = 'task_events_legacy'
              AND (day::timestamp AT TIME ZONE 'UTC') < (
                  SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]
                  )::timestamptz);
        EXECUTE format('CREATE TABLE %I (LIKE task_events INCLUDING DEFAULTS)', part);
        EXECUTE format(
            'ALTER TABLE task_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
            part, day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;

-- The old rows, as they are, as one partition; an empty old table is simply dropped.
DO $$
DECLARE
    newest timestamptz := (SELECT max(created_at) FROM task_events_legacy);
    bound timestamptz;
BEGIN
    IF newest IS NOT NULL THEN
        -- tomorrow (UTC), or the day after the newest row if a clock put one later
        bound := (GREATEST((now() AT TIME ZONE 'UTC')::date,
                           (newest AT TIME ZONE 'UTC')::date) + 1)::timestamp AT TIME ZONE 'UTC';
        EXECUTE format(
            'ALTER TABLE task_events ATTACH PARTITION task_events_legacy '
            'FOR VALUES FROM (MINVALUE) TO (%L)', bound);
    ELSE
        DROP TABLE task_events_legacy;
    END IF;
END
$$;

SELECT aivedio_ensure_event_partitions(7);
