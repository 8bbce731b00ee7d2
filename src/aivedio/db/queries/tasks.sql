-- name: claim_idempotency_key
-- Returns the key's task: a fresh key (or an expired one) is taken over by this request's task;
-- a live key returns nothing here and the caller reads the existing row.
INSERT INTO idempotency_keys (project_id, key, request_hash, task_id, expires_at)
VALUES ($1, $2, $3, $4, now() + $5::interval)
ON CONFLICT (project_id, key) DO UPDATE
    SET request_hash = EXCLUDED.request_hash, task_id = EXCLUDED.task_id,
        created_at = now(), expires_at = EXCLUDED.expires_at
    WHERE idempotency_keys.expires_at < now()
RETURNING task_id

-- name: get_idempotency_key
SELECT request_hash, task_id FROM idempotency_keys WHERE project_id = $1 AND key = $2

-- name: insert_task
INSERT INTO generation_tasks (id, tenant_id, project_id, user_id, provider, model, prompt,
                              params, status, stage, version, current_attempt_id, trace_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, 'created', 'submitting', 0, $9, $10)

-- name: insert_attempt
-- The attempt and its submit intent in one statement: no attempt exists that the submitter
-- would not send (migration 0007).
WITH attempt AS (
    INSERT INTO task_attempts (id, task_id, attempt_no, provider, model, client_request_id,
                               reason)
    VALUES ($1, $2, $3, $4, $5, $6, $7)
    RETURNING id, task_id
)
INSERT INTO submit_intents (attempt_id, task_id)
SELECT id, task_id FROM attempt

-- name: insert_cancel_intent
-- Written with the cancel_requested version; the cancel worker calls the provider.
INSERT INTO cancel_intents (attempt_id, task_id, trace_id) VALUES ($1, $2, $3)
ON CONFLICT (attempt_id) DO NOTHING

-- name: switch_attempt
UPDATE generation_tasks SET current_attempt_id = $2 WHERE id = $1

-- name: task_snapshot
SELECT t.id, t.project_id, t.status, t.stage, t.progress, t.version, t.last_event_id,
       t.error_code, t.asset_id, t.trace_id, t.created_at, t.updated_at,
       s.epoch, s.head
FROM generation_tasks t
JOIN event_streams s ON s.project_id = t.project_id
WHERE t.id = $1 AND t.project_id = $2

-- name: list_tasks
SELECT t.id, t.project_id, t.status, t.stage, t.progress, t.version, t.last_event_id,
       t.error_code, t.asset_id, t.trace_id, t.created_at, t.updated_at
FROM generation_tasks t
WHERE t.project_id = $1
  AND ($2::timestamptz IS NULL OR (t.created_at, t.id) < ($2, $3::uuid))
ORDER BY t.created_at DESC, t.id DESC
LIMIT $4

-- name: stream_position
SELECT epoch, head, floor FROM event_streams WHERE project_id = $1

-- name: task_events_of_task
-- (every task event is a 'task.status' one; the trace id is stored as bytes: migration 0016)
SELECT seq, epoch, task_version, 'task.status' AS event_type, source, public_payload,
       'trc_' || encode(trace_id, 'hex') AS trace_id, created_at
FROM task_events
WHERE task_id = $1
ORDER BY task_version

-- name: audit_of_task
SELECT id, outcome, reason, source, observed, provider_sequence, progress, task_version,
       trace_id, received_at
FROM observation_audit
WHERE task_id = $1
ORDER BY id

-- name: max_attempt_no
SELECT COALESCE(max(attempt_no), 0) FROM task_attempts WHERE task_id = $1

-- name: project_of_tenant
SELECT id FROM projects WHERE id = $1 AND tenant_id = $2

-- name: principal_of_key
SELECT tenant_id, user_id FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL

-- name: ensure_tenant
INSERT INTO tenants (id, name) VALUES ($1, $2)
ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
RETURNING id

-- name: ensure_project
INSERT INTO projects (id, tenant_id, name) VALUES ($1, $2, $3)
ON CONFLICT (tenant_id, name) DO UPDATE SET name = EXCLUDED.name
RETURNING id

-- name: ensure_stream
-- The epoch is the creation time in ms: a stream re-created (after a restore, say) gets a new
-- epoch, so every cursor issued before resets instead of replaying a different history.
INSERT INTO event_streams (project_id, epoch)
VALUES ($1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)
ON CONFLICT (project_id) DO NOTHING

-- name: insert_api_key
INSERT INTO api_keys (id, tenant_id, user_id, key_prefix, key_hash) VALUES ($1, $2, $3, $4, $5)
