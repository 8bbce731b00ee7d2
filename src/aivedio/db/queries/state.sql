-- name: lock_task_for_attempt
-- The task row is the aggregate lock: every state change of a task or its attempts takes it.
-- Only the lock; locked_attempts reads task and attempt afterwards, in a statement of its own.
-- Why not one SELECT ... JOIN ... FOR UPDATE OF t: a writer that waits for the lock gets the task
-- row re-read after the wait (READ COMMITTED re-fetches the locked rows) but the attempt's
-- columns as they were before it (the joined row is not re-fetched). Two inbox processors then
-- decided on a stale attempt: in an aivedio chaos run a late `running` (seq 3) passed the
-- sequence check after `succeeded` (seq 4) had committed, and overwrote the attempt's status.
SELECT id FROM generation_tasks
WHERE id = (SELECT task_id FROM task_attempts WHERE id = $1)
FOR UPDATE

-- name: lock_tasks_for_attempts
-- apply_many: the tasks of a batch of attempts ($1, uuid[]) locked in one statement, in task id
-- order (ORDER BY is applied before the row locks are taken), so two batches cannot deadlock on
-- task rows. Only the locks, for the reason above; locked_attempts reads the rows.
SELECT t.id FROM generation_tasks t
WHERE t.id IN (SELECT task_id FROM task_attempts WHERE id = ANY($1::uuid[]))
ORDER BY t.id
FOR UPDATE

-- name: locked_attempts
-- The attempts $1 (uuid[]) and their tasks, read after lock_task(s)_for_attempts took the task
-- rows: a new statement sees every commit of the lock's previous holders. locked_at is now()
-- (the transaction's start time), what write_event stores in progress_event_at, for deciding
-- later observations of a task.
SELECT t.id, t.tenant_id, t.project_id, t.user_id, t.status, t.stage, t.progress, t.version,
       t.current_attempt_id, t.progress_event_at, t.error_code, t.error_message, t.asset_id,
       a.id AS attempt_id, a.provider_status, a.last_provider_seq, a.last_provider_at,
       now() AS locked_at
FROM task_attempts a
JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = ANY($1::uuid[])
ORDER BY t.id, a.id

-- name: lock_task
-- A command on one task (cancel, retry): its row locked; locked_task reads it with its current
-- attempt afterwards (see lock_task_for_attempt for why two statements).
SELECT id FROM generation_tasks WHERE id = $1 AND project_id = $2 FOR UPDATE

-- name: locked_task
SELECT t.id, t.tenant_id, t.project_id, t.user_id, t.status, t.stage, t.progress, t.version,
       t.current_attempt_id, t.progress_event_at, t.error_code, t.error_message, t.asset_id,
       a.id AS attempt_id, a.provider_status, a.last_provider_seq, a.last_provider_at,
       a.attempt_no, a.provider, a.model
FROM generation_tasks t
LEFT JOIN task_attempts a ON a.id = t.current_attempt_id
WHERE t.id = $1

-- name: write_event
-- One statement, one round trip: take the project's next stream seq (the row lock serializes
-- writers of one project until commit, so seqs are contiguous and commit-ordered), insert the
-- task event, move the task to its new version (CAS on the old one), record what was seen on the
-- attempt, insert the outbox row, mark the inbox row processed.
-- A version that is not a public event ($23 false: it changes no public field) takes no seq and
-- inserts no task event; its outbox row has event_id and epoch null, and its audit row
-- (observation_audit, outcome 'applied') is written instead. Always returns one row.
-- The event's stored payload leaves out what its columns already say (task_id, task_version,
-- event_id = seq) and null fields: readers add them back (domain.public.stored_event,
-- gateway.frames.make_event); 130 of ~210 bytes per event (migration 0012, bench retention).
-- $1 project  $2 tenant  $3 task  $4 attempt  $5 new version  $6 public payload  $7 source
-- $8 trace  $9 occurred_at  $10 status  $11 stage  $12 progress  $13 error_code
-- $14 error_message  $15 asset  $16 terminal  $17 domain payload  $18 record attempt?
-- $19 provider_status  $20 last_provider_seq  $21 last_provider_at  $22 inbox id
-- $23 public event?  audit row (when not): $24 reason  $25 observed  $26 received_at
-- $27 provider  $28 provider_sequence  $29 progress  $30 dedup key
WITH stream AS (
    UPDATE event_streams SET head = head + 1, updated_at = now()
    WHERE project_id = $1 AND $23::boolean
    RETURNING epoch, head
), event AS (
    INSERT INTO task_events (project_id, epoch, seq, tenant_id, task_id, attempt_id,
                             task_version, event_type, public_payload, source, trace_id,
                             occurred_at, created_at)
    SELECT $1, stream.epoch, stream.head, $2, $3, $4, $5, 'task.status',
           jsonb_strip_nulls($6::jsonb - 'task_id' - 'task_version'), $7, $8, $9,
           clock_timestamp()  -- written after the stream lock: just before the commit
    FROM stream
), task AS (
    UPDATE generation_tasks
    SET status = $10, stage = $11, progress = $12, version = $5,
        last_event_id = COALESCE((SELECT head FROM stream), last_event_id),
        error_code = $13, error_message = $14, asset_id = $15,
        -- the last event of the stage: a version that is not an event keeps it
        progress_event_at = CASE WHEN $23::boolean THEN now() ELSE progress_event_at END,
        terminal_at = CASE WHEN $16::boolean THEN now() END,
        trace_id = COALESCE($8, trace_id),
        updated_at = now()
    WHERE id = $3 AND version = $5 - 1
    RETURNING id
), attempt AS (
    -- A webhook that changed something pushes the attempt's next poll out by the poller's
    -- WEBHOOK_PUSH_S (aivedio.polling.policy; a test keeps the two equal); a finished task's
    -- attempt is not polled again.
    UPDATE task_attempts
    SET provider_status = $19, last_provider_seq = $20, last_provider_at = $21, updated_at = now(),
        next_poll_at = CASE
            WHEN $16::boolean THEN NULL
            WHEN $7 = 'webhook' AND next_poll_at IS NOT NULL
                THEN GREATEST(next_poll_at, now() + interval '30 seconds')
            ELSE next_poll_at
        END
    WHERE id = $4 AND $18::boolean
    RETURNING id
), outbox AS (
    INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
    SELECT 'task', $3, $5, 'task.status.changed',
           $17::jsonb || jsonb_build_object('event_id', (SELECT head FROM stream),
                                            'epoch', (SELECT epoch FROM stream))
), audit AS (
    INSERT INTO observation_audit (task_id, attempt_id, project_id, outcome, reason, source,
                                   provider, observed, provider_sequence, progress,
                                   task_version, inbox_id, dedup_key, trace_id, received_at)
    SELECT $3, $4, $1, 'applied', $24, $7, $27, $25, $28, $29, $5, $22, $30, $8, $26
    WHERE NOT $23::boolean
), inbox AS (
    UPDATE provider_callback_inbox
    SET process_status = 'processed', processed_at = now()
    WHERE id = $22
      AND process_status <> 'processed'  -- the inbox processor marked it first
    RETURNING id
)
SELECT (SELECT epoch FROM stream) AS epoch, (SELECT head FROM stream) AS head,
       (SELECT count(*) FROM task) AS tasks_updated

-- name: record_unapplied
-- An observation that changed nothing: its audit row, what it taught us about the attempt, its
-- reconciliation item (conflicts, stale-attempt results) and the inbox row, in one statement.
-- $1 task  $2 attempt  $3 project  $4 outcome  $5 reason  $6 source  $7 provider  $8 observed
-- $9 provider_sequence  $10 progress  $11 task_version  $12 inbox id  $13 dedup key  $14 trace
-- $15 received_at  $16 record attempt?  $17 provider_status  $18 last_provider_seq
-- $19 last_provider_at  $20 reconciliation kind  $21 reconciliation detail
WITH audit AS (
    INSERT INTO observation_audit (task_id, attempt_id, project_id, outcome, reason, source,
                                   provider, observed, provider_sequence, progress,
                                   task_version, inbox_id, dedup_key, trace_id, received_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
    RETURNING id
), attempt AS (
    UPDATE task_attempts
    SET provider_status = $17, last_provider_seq = $18, last_provider_at = $19, updated_at = now()
    WHERE id = $2 AND $16::boolean
    RETURNING id
), item AS (
    INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id, detail)
    SELECT $20, $1, $2, $3, $21::jsonb
    WHERE $20::text IS NOT NULL
    ON CONFLICT (kind, attempt_id) WHERE state = 'open' DO NOTHING
    RETURNING id
), inbox AS (
    UPDATE provider_callback_inbox
    SET process_status = 'processed', processed_at = now()
    WHERE id = $12
      AND process_status <> 'processed'  -- the inbox processor marked it first
    RETURNING id
)
SELECT (SELECT id FROM audit) AS audit_id, (SELECT id FROM item) AS item_id

-- name: write_events
-- apply_many: write_event for a batch of events in one statement, one round trip. Element i of
-- every array is one event; the events come in write order (by project, then in the order they
-- were decided), and each one is exactly what write_event would write for it in that order:
-- - the stream rows of the batch's projects are locked in project id order (the locked CTE is
--   materialized, and the stream UPDATE only touches rows it produced), so two batches cannot
--   deadlock on them; each head moves by the project's public event count and public events
--   are numbered from the old head, contiguous and in order;
-- - a version that is not a public event ($23 false) takes no seq and no task event: its
--   outbox row has event_id and epoch null and its audit row is written instead (write_event);
-- - a task with several events ends as its last one left it (version CAS on the first one's
--   version - 1, last_event_id its last public seq, the last non-NULL trace id);
-- - an attempt takes the provider fields of its last event (the caller passes the batch's final
--   values there) and next_poll_at as write_event's CASE applied event after event would leave
--   it (any terminal: NULL; else any webhook: pushed out by 30 seconds).
-- Returns one row per event, in order (seq and epoch null for a version that is not public).
-- $1 project[]  $2 tenant[]  $3 task[]  $4 attempt[]  $5 new version[]  $6 public payload[]
-- $7 source[]  $8 trace[]  $9 occurred_at[]  $10 status[]  $11 stage[]  $12 progress[]
-- $13 error_code[]  $14 error_message[]  $15 asset[]  $16 terminal[]  $17 domain payload[]
-- $18 record attempt?[]  $19 provider_status[]  $20 last_provider_seq[]  $21 last_provider_at[]
-- $22 inbox id[]  $23 public event?[]  audit rows: $24 reason[]  $25 observed[]
-- $26 received_at[]  $27 provider[]  $28 provider_sequence[]  $29 progress[]  $30 dedup key[]
WITH input AS MATERIALIZED (
    SELECT *
    FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::bigint[], $6::text[],
                $7::text[], $8::text[], $9::timestamptz[], $10::text[], $11::text[],
                $12::smallint[], $13::text[], $14::text[], $15::uuid[], $16::boolean[],
                $17::text[], $18::boolean[], $19::text[], $20::bigint[], $21::timestamptz[],
                $22::bigint[], $23::boolean[], $24::text[], $25::text[], $26::timestamptz[],
                $27::text[], $28::bigint[], $29::smallint[], $30::text[])
        WITH ORDINALITY AS i (project_id, tenant_id, task_id, attempt_id, version, public_payload,
                              source, trace_id, occurred_at, status, stage, progress, error_code,
                              error_message, asset_id, terminal, payload, record_attempt,
                              provider_status, last_provider_seq, last_provider_at, inbox_id,
                              public, audit_reason, audit_observed, audit_received_at,
                              audit_provider, audit_provider_sequence, audit_progress,
                              audit_dedup_key, ord)
), locked AS MATERIALIZED (
    SELECT project_id FROM event_streams
    WHERE project_id IN (SELECT project_id FROM input WHERE public)
    ORDER BY project_id
    FOR UPDATE
), stream AS (
    UPDATE event_streams s
    SET head = s.head + c.n, updated_at = now()
    FROM (SELECT l.project_id,
                 (SELECT count(*) FROM input WHERE input.project_id = l.project_id AND public) AS n
          FROM locked l) c
    WHERE s.project_id = c.project_id
    RETURNING s.project_id, s.epoch, s.head - c.n AS base
), numbered AS (
    SELECT i.*,
           CASE WHEN i.public THEN st.epoch END AS epoch,
           CASE WHEN i.public
                THEN st.base + row_number() OVER (PARTITION BY i.project_id, i.public
                                                  ORDER BY i.ord)
           END AS seq
    FROM input i
    LEFT JOIN stream st ON st.project_id = i.project_id
), event AS (
    INSERT INTO task_events (project_id, epoch, seq, tenant_id, task_id, attempt_id,
                             task_version, event_type, public_payload, source, trace_id,
                             occurred_at, created_at)
    SELECT project_id, epoch, seq, tenant_id, task_id, attempt_id, version, 'task.status',
           jsonb_strip_nulls(public_payload::jsonb - 'task_id' - 'task_version'), source, trace_id,
           occurred_at, clock_timestamp()
    FROM numbered
    WHERE public
    ORDER BY ord
), last_event AS (
    SELECT DISTINCT ON (task_id) *
    FROM numbered
    ORDER BY task_id, ord DESC
), per_task AS (
    SELECT task_id, min(version) AS first_version,
           (array_agg(trace_id ORDER BY ord DESC) FILTER (WHERE trace_id IS NOT NULL))[1] AS trace_id,
           max(seq) AS last_seq,
           bool_or(public) AS any_public
    FROM numbered
    GROUP BY task_id
), task AS (
    UPDATE generation_tasks t
    SET status = e.status, stage = e.stage, progress = e.progress, version = e.version,
        last_event_id = COALESCE(p.last_seq, t.last_event_id),
        error_code = e.error_code, error_message = e.error_message, asset_id = e.asset_id,
        -- write_event event after event: the time of the last public one, if any
        progress_event_at = CASE WHEN p.any_public THEN now() ELSE t.progress_event_at END,
        terminal_at = CASE WHEN e.terminal THEN now() END,
        trace_id = COALESCE(p.trace_id, t.trace_id),
        updated_at = now()
    FROM last_event e
    JOIN per_task p ON p.task_id = e.task_id
    WHERE t.id = e.task_id AND t.version = p.first_version - 1
    RETURNING t.id
), per_attempt AS (
    SELECT DISTINCT ON (attempt_id) attempt_id, provider_status, last_provider_seq,
           last_provider_at,
           bool_or(terminal) OVER w AS any_terminal,
           bool_or(source = 'webhook') OVER w AS any_webhook
    FROM numbered
    WHERE record_attempt
    WINDOW w AS (PARTITION BY attempt_id)
    ORDER BY attempt_id, ord DESC
), attempt AS (
    UPDATE task_attempts a
    SET provider_status = p.provider_status, last_provider_seq = p.last_provider_seq,
        last_provider_at = p.last_provider_at, updated_at = now(),
        next_poll_at = CASE
            WHEN p.any_terminal THEN NULL
            WHEN p.any_webhook AND a.next_poll_at IS NOT NULL
                THEN GREATEST(a.next_poll_at, now() + interval '30 seconds')
            ELSE a.next_poll_at
        END
    FROM per_attempt p
    WHERE a.id = p.attempt_id
    RETURNING a.id
), outbox AS (
    INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
    SELECT 'task', task_id, version, 'task.status.changed',
           payload::jsonb || jsonb_build_object('event_id', seq, 'epoch', epoch)
    FROM numbered
    ORDER BY ord
), audit AS (
    INSERT INTO observation_audit (task_id, attempt_id, project_id, outcome, reason, source,
                                   provider, observed, provider_sequence, progress,
                                   task_version, inbox_id, dedup_key, trace_id, received_at)
    SELECT task_id, attempt_id, project_id, 'applied', audit_reason, source, audit_provider,
           audit_observed, audit_provider_sequence, audit_progress, version, inbox_id,
           audit_dedup_key, trace_id, audit_received_at
    FROM numbered
    WHERE NOT public
    ORDER BY ord
), inbox AS (
    UPDATE provider_callback_inbox
    SET process_status = 'processed', processed_at = now()
    WHERE id IN (SELECT inbox_id FROM input WHERE inbox_id IS NOT NULL)
      AND process_status <> 'processed'  -- the inbox processor marked it first
    RETURNING id
)
SELECT ord, epoch, seq, (SELECT count(*) FROM task) AS tasks_updated,
       (SELECT count(DISTINCT task_id) FROM input) AS tasks
FROM numbered
ORDER BY ord
