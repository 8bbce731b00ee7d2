-- name: lock_task_for_attempt
-- The task row is the aggregate lock: every state change of a task or its attempts takes it.
SELECT t.id, t.tenant_id, t.project_id, t.user_id, t.status, t.stage, t.progress, t.version,
       t.current_attempt_id, t.progress_event_at, t.error_code, t.error_message, t.asset_id,
       a.id AS attempt_id, a.provider_status, a.last_provider_seq, a.last_provider_at
FROM task_attempts a
JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = $1
FOR UPDATE OF t

-- name: lock_task
SELECT t.id, t.tenant_id, t.project_id, t.user_id, t.status, t.stage, t.progress, t.version,
       t.current_attempt_id, t.progress_event_at, t.error_code, t.error_message, t.asset_id,
       a.id AS attempt_id, a.provider_status, a.last_provider_seq, a.last_provider_at,
       a.attempt_no, a.provider, a.model
FROM generation_tasks t
LEFT JOIN task_attempts a ON a.id = t.current_attempt_id
WHERE t.id = $1 AND t.project_id = $2
FOR UPDATE OF t

-- name: write_event
-- One statement, one round trip: take the project's next stream seq (the row lock serializes
-- writers of one project until commit, so seqs are contiguous and commit-ordered), insert the
-- task event, move the task to its new version (CAS on the old one), record what was seen on the
-- attempt, insert the outbox row, mark the inbox row processed.
-- $1 project  $2 tenant  $3 task  $4 attempt  $5 new version  $6 public payload  $7 source
-- $8 trace  $9 occurred_at  $10 status  $11 stage  $12 progress  $13 error_code
-- $14 error_message  $15 asset  $16 terminal  $17 domain payload  $18 record attempt?
-- $19 provider_status  $20 last_provider_seq  $21 last_provider_at  $22 inbox id
WITH stream AS (
    UPDATE event_streams SET head = head + 1, updated_at = now()
    WHERE project_id = $1
    RETURNING epoch, head
), event AS (
    INSERT INTO task_events (project_id, epoch, seq, tenant_id, task_id, attempt_id,
                             task_version, event_type, public_payload, source, trace_id,
                             occurred_at)
    SELECT $1, stream.epoch, stream.head, $2, $3, $4, $5, 'task.status',
           $6::jsonb || jsonb_build_object('event_id', stream.head), $7, $8, $9
    FROM stream
), task AS (
    UPDATE generation_tasks
    SET status = $10, stage = $11, progress = $12, version = $5,
        last_event_id = (SELECT head FROM stream),
        error_code = $13, error_message = $14, asset_id = $15,
        progress_event_at = now(),
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
           $17::jsonb || jsonb_build_object('event_id', stream.head, 'epoch', stream.epoch)
    FROM stream
), inbox AS (
    UPDATE provider_callback_inbox
    SET process_status = 'processed', processed_at = now()
    WHERE id = $22
    RETURNING id
)
SELECT stream.epoch, stream.head, (SELECT count(*) FROM task) AS tasks_updated
FROM stream

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
    RETURNING id
)
SELECT (SELECT id FROM audit) AS audit_id, (SELECT id FROM item) AS item_id
