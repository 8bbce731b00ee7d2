-- name: insert_media_operation
-- On provider_succeeded. A redelivered message hits uq_media_operation and inserts nothing.
INSERT INTO media_operations (id, task_id, attempt_id, project_id, tenant_id, operation_type,
                              asset_id, source_ref, trace_id)
SELECT $1, t.id, a.id, t.project_id, t.tenant_id, $3, $4, a.provider || ':' || COALESCE(a.provider_task_id, '?'), $5
FROM task_attempts a
JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = $2
ON CONFLICT (task_id, attempt_id, operation_type) DO NOTHING
RETURNING id

-- name: claim_media_operations
-- Due pending operations, and running ones whose lease ran out (their worker died). SKIP LOCKED
-- lets any number of workers claim at once; each claim takes a new lease_token that fences
-- every later write of that worker.
WITH due AS (
    SELECT id FROM media_operations
    WHERE (state = 'pending' AND next_attempt_at <= now())
       OR (state = 'running' AND lease_until < now())
    ORDER BY next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE media_operations m
SET state = 'running',
    tries = m.tries + 1,
    lease_until = now() + make_interval(secs => $2),
    lease_token = gen_random_uuid(),
    updated_at = now()
FROM due
WHERE m.id = due.id
RETURNING m.id, m.task_id, m.attempt_id, m.project_id, m.tenant_id, m.operation_type, m.tries,
          m.asset_id, m.lease_token, m.trace_id

-- name: extend_media_lease
UPDATE media_operations
SET lease_until = now() + make_interval(secs => $3), updated_at = now()
WHERE id = $1 AND lease_token = $2 AND state = 'running'
RETURNING lease_until

-- name: media_operation_context
-- Where the task is now and which provider job holds the output.
SELECT t.status AS task_status, t.current_attempt_id, t.asset_id AS task_asset_id,
       a.provider, a.provider_task_id
FROM media_operations m
JOIN generation_tasks t ON t.id = m.task_id
JOIN task_attempts a ON a.id = m.attempt_id
WHERE m.id = $1

-- name: set_media_stage
UPDATE media_operations SET stage = $3, updated_at = now()
WHERE id = $1 AND lease_token = $2 AND state = 'running'
RETURNING id

-- name: retry_media_operation
UPDATE media_operations
SET state = 'pending', next_attempt_at = now() + make_interval(secs => $3), lease_until = NULL,
    lease_token = NULL, error_code = $4, error_detail = $5, updated_at = now()
WHERE id = $1 AND lease_token = $2 AND state = 'running'
RETURNING id

-- name: finish_media_operation
-- state 'succeeded' or 'failed'; error_code is the public code of a failure.
UPDATE media_operations
SET state = $3, error_code = $4, error_detail = $5, lease_until = NULL, lease_token = NULL,
    updated_at = now(), finished_at = now()
WHERE id = $1 AND lease_token = $2 AND state = 'running'
RETURNING id

-- name: insert_asset
INSERT INTO assets (id, task_id, attempt_id, project_id, tenant_id, storage_key, original_key,
                    content_type, size_bytes, duration_s, width, height, codec)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
ON CONFLICT (task_id, attempt_id) DO NOTHING
RETURNING id

-- name: asset_of_project
-- An asset as its tenant may see it: the project must belong to the caller's tenant.
SELECT a.id, a.project_id, a.storage_key, a.content_type, a.size_bytes
FROM assets a
JOIN projects p ON p.id = a.project_id
WHERE a.id = $1 AND a.project_id = $2 AND p.tenant_id = $3

-- name: asset_storage
SELECT id, storage_key, content_type, size_bytes FROM assets WHERE id = $1

-- name: media_end_leases
-- Runs the database interrupted (aivedio.db.leases): the next claim takes the operation as one
-- whose lease ran out. Fenced by each run's token. $1 operation ids  $2 lease tokens
UPDATE media_operations m SET lease_until = now(), updated_at = now()
FROM unnest($1::uuid[], $2::uuid[]) AS l (id, token)
WHERE m.id = l.id AND m.lease_token = l.token AND m.state = 'running'
