-- name: poll_claim
-- Claim due attempts for one poller: the oldest due first (no task starves), interleaved by
-- tenant within the batch (each tenant's 1st due attempt, then each one's 2nd, ...). Due rows
-- whose task no longer needs polling (finished, handed to media, or a stale attempt) are
-- stopped here (next_poll_at NULL) so they never sit at the head of the index. SKIP LOCKED: any
-- number of replicas claim side by side; the lease (and its token, which fences the write-back)
-- keeps a second replica away while the query runs.
-- $1 statuses to poll  $2 rows to scan  $3 batch  $4 lease seconds  $5 providers to skip
WITH due AS (
    SELECT a.id, a.task_id, a.next_poll_at
    FROM task_attempts a
    WHERE a.next_poll_at <= now()
      AND a.provider_task_id IS NOT NULL
      AND (a.poll_lease_until IS NULL OR a.poll_lease_until < now())
      AND a.provider <> ALL ($5::text[])
    ORDER BY a.next_poll_at
    LIMIT $2
    FOR UPDATE OF a SKIP LOCKED
), facts AS (
    SELECT due.id, due.next_poll_at, t.tenant_id,
           (t.status = ANY ($1::text[]) AND t.current_attempt_id = due.id) AS eligible
    FROM due JOIN generation_tasks t ON t.id = due.task_id
), picked AS (
    SELECT id FROM (
        SELECT id, next_poll_at,
               row_number() OVER (PARTITION BY tenant_id ORDER BY next_poll_at) AS turn
        FROM facts WHERE eligible
    ) ranked
    ORDER BY turn, next_poll_at
    LIMIT $3
), stopped AS (
    UPDATE task_attempts a
    SET next_poll_at = NULL, poll_lease_until = NULL, poll_lease_token = NULL
    FROM facts
    WHERE a.id = facts.id AND NOT facts.eligible
    RETURNING a.id
)
UPDATE task_attempts a
SET poll_lease_until = now() + make_interval(secs => $4),
    poll_lease_token = gen_random_uuid(),
    poll_started_at = COALESCE(a.poll_started_at, now())
FROM picked, generation_tasks t
WHERE a.id = picked.id AND t.id = a.task_id
RETURNING a.id, a.task_id, t.tenant_id, t.project_id, t.status, a.provider, a.model,
          a.provider_task_id, a.provider_status, a.last_provider_seq, a.poll_failures,
          a.poll_unchanged, a.poll_lease_token, a.next_poll_at AS due_at,
          extract(epoch FROM now() - a.poll_started_at)::float8 AS age_s,
          extract(epoch FROM now() - a.next_poll_at)::float8 AS lag_s,
          (SELECT count(*) FROM stopped) AS stopped

-- name: poll_reschedule
-- Write back one query's result (fenced by the claim's lease token): the next due time (none
-- when the task no longer needs polling; never earlier than a webhook pushed it), the counters,
-- the last error and its redacted sample; the lease ends. Returns nothing when the lease was
-- lost (another replica owns the attempt now).
-- $1 attempt  $2 lease token  $3 delay s  $4 nominal s  $5 failures  $6 unchanged
-- $7 error code  $8 error sample  $9 statuses to poll
UPDATE task_attempts a
SET next_poll_at = CASE WHEN t.status = ANY ($9::text[]) AND t.current_attempt_id = a.id
                        THEN GREATEST(a.next_poll_at, now() + make_interval(secs => $3)) END,
    poll_interval_s = $4,
    poll_failures = $5,
    poll_unchanged = $6,
    poll_error = $7,
    poll_error_sample = COALESCE($8, a.poll_error_sample),
    poll_lease_until = NULL,
    poll_lease_token = NULL,
    polled_at = now()
FROM generation_tasks t
WHERE a.id = $1 AND a.poll_lease_token = $2 AND t.id = a.task_id
RETURNING a.next_poll_at, extract(epoch FROM a.next_poll_at - now())::float8 AS delay_s

-- name: poll_release
-- Give claimed attempts back without querying (no rate-limit token, breaker open): the lease
-- stays until the wait is over, next_poll_at is kept so they keep their place in the queue.
-- $1 attempt ids  $2 lease tokens  $3 waits (s)
UPDATE task_attempts a
SET poll_lease_until = now() + make_interval(secs => r.wait_s), poll_lease_token = NULL
FROM unnest($1::uuid[], $2::uuid[], $3::float8[]) AS r (id, token, wait_s)
WHERE a.id = r.id AND a.poll_lease_token = r.token

-- name: poll_reconcile
-- Flag an attempt for the reconciler (404 long after submit, repeated malformed answers).
-- $1 attempt  $2 kind  $3 detail
INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id, detail)
SELECT $2, a.task_id, a.id, t.project_id, $3::jsonb
FROM task_attempts a JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = $1
ON CONFLICT (kind, attempt_id) WHERE state = 'open' DO NOTHING

-- name: poll_demand
-- The poll demand in flight, per (provider, model, tenant): the sum of 1 / nominal interval.
-- An attempt not polled yet counts with $1 seconds.
SELECT a.provider, a.model, t.tenant_id::text AS tenant, count(*) AS attempts,
       sum(1.0 / GREATEST(COALESCE(a.poll_interval_s, $1), 0.1))::float8 AS demand_qps
FROM task_attempts a JOIN generation_tasks t ON t.id = a.task_id
WHERE a.next_poll_at IS NOT NULL AND a.provider_task_id IS NOT NULL
GROUP BY 1, 2, 3

-- name: poll_end_leases
-- Polls whose result the database kept the poller from writing (aivedio.db.leases): due again
-- now rather than when the lease runs out. Fenced by each lease's token. $1 attempt ids  $2 tokens
UPDATE task_attempts a SET poll_lease_until = now()
FROM unnest($1::uuid[], $2::uuid[]) AS l (id, token)
WHERE a.id = l.id AND a.poll_lease_token = l.token
