-- name: lock_task_by_id
SELECT t.id, t.tenant_id, t.project_id, t.user_id, t.status, t.version, t.provider, t.model,
       t.current_attempt_id AS attempt_id, t.stage, t.progress, t.error_code, t.asset_id
FROM generation_tasks t
WHERE t.id = $1
FOR UPDATE OF t

-- name: open_items_of_attempt
SELECT id, kind FROM reconciliation_items WHERE attempt_id = $1 AND state = 'open' ORDER BY id

-- name: resolve_items_of_attempt
-- $1 attempt  $2 resolution  $3 operator
UPDATE reconciliation_items
SET state = 'resolved', resolution = $2, resolved_by = $3, resolved_at = now()
WHERE attempt_id = $1 AND state = 'open'
RETURNING id

-- name: insert_resolved_item
-- An item that is born resolved: the audit record of an operator's action (resubmit).
-- $1 kind  $2 task  $3 attempt  $4 project  $5 detail  $6 resolution  $7 operator
INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id, state, detail,
                                  resolution, resolved_by, resolved_at)
VALUES ($1, $2, $3, $4, 'resolved', $5::jsonb, $6, $7, now())
RETURNING id

-- name: open_item
-- At most one open item per (kind, attempt); returns nothing when one is already open.
-- $1 kind  $2 attempt  $3 detail
INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id, detail)
SELECT $1, t.id, a.id, t.project_id, $3::jsonb
FROM task_attempts a JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = $2
ON CONFLICT (kind, attempt_id) WHERE state = 'open' DO NOTHING
RETURNING id

-- name: list_items
-- $1 state (NULL: any)  $2 limit
SELECT i.id, i.kind, i.task_id, i.attempt_id, i.project_id, i.state, i.detail, i.resolution,
       i.resolved_by, i.created_at, i.resolved_at, t.status AS task_status,
       a.provider, a.provider_task_id, a.client_request_id
FROM reconciliation_items i
JOIN generation_tasks t ON t.id = i.task_id
JOIN task_attempts a ON a.id = i.attempt_id
WHERE $1::text IS NULL OR i.state = $1
ORDER BY i.id
LIMIT $2

-- name: resolve_item
-- $1 id  $2 resolution  $3 operator
UPDATE reconciliation_items
SET state = 'resolved', resolution = $2, resolved_by = $3, resolved_at = now()
WHERE id = $1 AND state = 'open'
RETURNING id, kind, task_id, attempt_id, state, resolution, resolved_by, resolved_at

-- name: item_state
SELECT state FROM reconciliation_items WHERE id = $1

-- name: claim_overdue_attempts
-- Current attempts the provider still works on whose task has not changed for longer than the
-- expected maximum duration (per "provider/model", then "provider/*", then the default), each
-- claimed at most once per check interval across all replicas (the upsert is the claim).
-- $1 statuses  $2 default max  $3 keys  $4 seconds  $5 check interval  $6 limit
WITH limits AS (
    SELECT k, s FROM unnest($3::text[], $4::float8[]) AS m(k, s)
), candidates AS (
    SELECT a.id
    FROM generation_tasks t
    JOIN task_attempts a ON a.id = t.current_attempt_id
    LEFT JOIN reconcile_checks c ON c.attempt_id = a.id
    WHERE t.status = ANY($1::text[])
      AND a.provider_task_id IS NOT NULL
      AND (c.checked_at IS NULL OR c.checked_at < now() - $5::interval)
      AND t.updated_at < now() - make_interval(secs => COALESCE(
            (SELECT s FROM limits WHERE k = a.provider || '/' || a.model),
            (SELECT s FROM limits WHERE k = a.provider || '/*'),
            $2))
    ORDER BY t.updated_at
    LIMIT $6
)
INSERT INTO reconcile_checks AS rc (attempt_id, checked_at)
SELECT id, now() FROM candidates
ON CONFLICT (attempt_id) DO UPDATE SET checked_at = now(), checks = rc.checks + 1
    WHERE rc.checked_at < now() - $5::interval
RETURNING attempt_id

-- name: attempts_to_query
SELECT a.id AS attempt_id, a.provider, a.provider_task_id, t.trace_id
FROM task_attempts a JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = ANY($1::uuid[])

-- name: record_check_result
UPDATE reconcile_checks SET last_result = $2 WHERE attempt_id = $1

-- name: claim_unknown_submits
-- Unknown submits of current, unfinished attempts due for a lookup; the next lookup is pushed
-- out by the claim itself, so replicas never look one up twice at once.
-- $1 lookup interval  $2 limit
WITH due AS (
    SELECT i.attempt_id
    FROM submit_intents i
    JOIN generation_tasks t ON t.current_attempt_id = i.attempt_id
    WHERE i.state = 'unknown' AND i.next_attempt_at <= now()
      AND t.status NOT IN ('ready', 'failed', 'canceled')
    ORDER BY i.next_attempt_at
    LIMIT $2
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE submit_intents i
SET lookups = i.lookups + 1, next_attempt_at = now() + $1::interval, updated_at = now()
FROM due, task_attempts a
WHERE i.attempt_id = due.attempt_id AND a.id = i.attempt_id
RETURNING i.attempt_id, i.unknown_at, i.lookups, a.provider, a.client_request_id,
          (SELECT trace_id FROM generation_tasks WHERE id = a.task_id) AS trace_id

-- name: submit_intent_found
-- The reconciler found the job of an unknown submit.
UPDATE submit_intents
SET state = 'accepted', last_error_code = NULL, updated_at = now()
WHERE attempt_id = $1 AND state = 'unknown'
RETURNING attempt_id

-- name: requeue_stuck_inbox
-- Inbox rows pending / retry for longer than $1 past their due time and not leased by a
-- processor (columns of migration 0005): due now again, or dead once they used up the
-- processor's tries ($2). Orphans have their own backoff and dead-letter path in the processor.
-- $1 stuck after  $2 max tries  $3 limit
WITH stuck AS (
    SELECT id, retry_count
    FROM provider_callback_inbox
    WHERE process_status IN ('pending', 'retry')
      AND COALESCE(next_retry_at, received_at) < now() - $1::interval
      AND (lease_until IS NULL OR lease_until < now())
    ORDER BY id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE provider_callback_inbox i
SET process_status = CASE WHEN stuck.retry_count >= $2 THEN 'dead' ELSE i.process_status END,
    next_retry_at = CASE WHEN stuck.retry_count >= $2 THEN i.next_retry_at ELSE now() END,
    last_error_code = CASE WHEN stuck.retry_count >= $2 THEN 'stuck' ELSE i.last_error_code END
FROM stuck
WHERE i.id = stuck.id
RETURNING i.id, i.process_status

-- name: resolve_recovered_poll_items
-- Open poll_not_found / poll_malformed items the facts have overtaken: the attempt was polled
-- successfully after the item was opened ('recovered'), or it is no longer the task's current
-- attempt or its task is finished ('attempt_finished'). Items still failing stay open.
-- $1 terminal statuses  $2 limit
WITH candidates AS (
    SELECT i.id,
           CASE WHEN t.current_attempt_id IS DISTINCT FROM a.id OR t.status = ANY ($1::text[])
                THEN 'attempt_finished' ELSE 'recovered' END AS resolution
    FROM reconciliation_items i
    JOIN task_attempts a ON a.id = i.attempt_id
    JOIN generation_tasks t ON t.id = i.task_id
    WHERE i.state = 'open'
      AND i.kind IN ('poll_not_found', 'poll_malformed')
      AND (t.current_attempt_id IS DISTINCT FROM a.id
           OR t.status = ANY ($1::text[])
           OR (a.poll_error IS NULL AND a.polled_at > i.created_at))
    ORDER BY i.id
    LIMIT $2
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE reconciliation_items i
SET state = 'resolved', resolution = c.resolution, resolved_by = 'reconciler', resolved_at = now()
FROM candidates c
WHERE i.id = c.id
RETURNING i.id, i.kind, i.attempt_id, i.resolution

-- name: purge_browser_sessions
-- Sessions that expired, or were revoked, longer than $1 ago; no stream can still use them.
-- $1 retention  $2 limit
DELETE FROM browser_sessions
WHERE id IN (
    SELECT id FROM browser_sessions
    WHERE expires_at < now() - $1::interval
    UNION ALL
    SELECT id FROM browser_sessions
    WHERE revoked_at < now() - $1::interval
    LIMIT $2
)
