-- name: claim_submit_intents
-- Due intents of tasks that still want their submit, leased to this replica. A 'sending' intent
-- whose lease expired comes back with previous_state = 'sending': its create may have been sent.
-- A task waiting for its cancel is claimed only when a create may already exist (maybe_sent, or
-- a lease expired mid-send): the submitter settles it (same key again, or unknown), so the cancel
-- worker gets a provider id to cancel or a lookup case.
-- $1 limit  $2 lease  $3 lease token
WITH due AS (
    SELECT i.attempt_id, i.state AS previous_state
    FROM submit_intents i
    JOIN task_attempts a ON a.id = i.attempt_id
    JOIN generation_tasks t ON t.id = a.task_id
    WHERE i.state IN ('pending', 'sending')
      AND i.next_attempt_at <= now()
      AND (i.lease_until IS NULL OR i.lease_until < now())
      AND t.current_attempt_id = i.attempt_id
      AND (t.status = 'created'
           OR (t.status = 'cancel_requested' AND (i.maybe_sent OR i.state = 'sending')))
    ORDER BY i.next_attempt_at
    LIMIT $1
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE submit_intents i
SET state = 'sending', lease_until = now() + $2::interval, lease_token = $3,
    tries = i.tries + 1, updated_at = now()
FROM due, task_attempts a, generation_tasks t
WHERE i.attempt_id = due.attempt_id AND a.id = i.attempt_id AND t.id = a.task_id
RETURNING i.attempt_id, i.task_id, i.tries, i.maybe_sent, due.previous_state,
          a.provider, a.model, a.client_request_id, a.provider_task_id,
          t.prompt, t.params, t.trace_id

-- name: record_provider_task_id
-- The provider's id for the attempt (kept if the inbox processor recorded it first) and the
-- first poll time. Returns the id on the row: a different one is a conflict for the caller.
-- $1 attempt  $2 provider task id  $3 first poll delay
UPDATE task_attempts
SET provider_task_id = COALESCE(provider_task_id, $2),
    next_poll_at = COALESCE(next_poll_at, now() + $3::interval),
    updated_at = now()
WHERE id = $1
RETURNING provider_task_id

-- name: submit_intent_accepted
UPDATE submit_intents
SET state = 'accepted', lease_until = NULL, lease_token = NULL, last_error_code = NULL,
    updated_at = now()
WHERE attempt_id = $1

-- name: submit_intent_retry
-- Back to pending after a failure that did not create a job (or may have, with a provider that
-- honours the key: maybe_sent). Only by the lease holder.
-- $1 attempt  $2 lease token  $3 delay  $4 error code  $5 maybe sent
UPDATE submit_intents
SET state = 'pending', next_attempt_at = now() + $3::interval, lease_until = NULL,
    lease_token = NULL, last_error_code = $4, maybe_sent = maybe_sent OR $5, updated_at = now()
WHERE attempt_id = $1 AND lease_token = $2 AND state = 'sending'
RETURNING attempt_id

-- name: submit_intent_finish
-- A final intent state (unknown, rejected) by the lease holder.
-- $1 attempt  $2 lease token  $3 state  $4 error code
UPDATE submit_intents
SET state = $3, lease_until = NULL, lease_token = NULL, last_error_code = $4,
    maybe_sent = maybe_sent OR $3 = 'unknown',
    unknown_at = CASE WHEN $3 = 'unknown' THEN now() ELSE unknown_at END,
    next_attempt_at = CASE WHEN $3 = 'unknown' THEN now() ELSE next_attempt_at END,
    updated_at = now()
WHERE attempt_id = $1 AND lease_token = $2 AND state = 'sending'
RETURNING attempt_id

-- name: lock_submit_intent
SELECT attempt_id, state, maybe_sent, lease_until FROM submit_intents
WHERE attempt_id = $1
FOR UPDATE

-- name: submit_intent_cancel
UPDATE submit_intents
SET state = 'canceled', lease_until = NULL, lease_token = NULL, updated_at = now()
WHERE attempt_id = $1 AND state = 'pending'
RETURNING attempt_id

-- name: claim_cancel_intents
-- $1 limit  $2 lease  $3 lease token
WITH due AS (
    SELECT c.attempt_id
    FROM cancel_intents c
    WHERE c.state IN ('pending', 'sending')
      AND c.next_attempt_at <= now()
      AND (c.lease_until IS NULL OR c.lease_until < now())
    ORDER BY c.next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE cancel_intents c
SET state = 'sending', lease_until = now() + $2::interval, lease_token = $3,
    tries = c.tries + 1, updated_at = now()
FROM due, task_attempts a, generation_tasks t
WHERE c.attempt_id = due.attempt_id AND a.id = c.attempt_id AND t.id = a.task_id
RETURNING c.attempt_id, c.task_id, c.tries, c.trace_id, a.provider, a.provider_task_id,
          t.status, t.current_attempt_id,
          (SELECT s.state FROM submit_intents s WHERE s.attempt_id = c.attempt_id)
              AS submit_state

-- name: cancel_intent_retry
-- $1 attempt  $2 lease token  $3 delay  $4 error code
UPDATE cancel_intents
SET state = 'pending', next_attempt_at = now() + $3::interval, lease_until = NULL,
    lease_token = NULL, last_error_code = $4, updated_at = now()
WHERE attempt_id = $1 AND lease_token = $2 AND state = 'sending'
RETURNING attempt_id

-- name: cancel_intent_finish
-- $1 attempt  $2 lease token  $3 state (done | failed)  $4 result  $5 error code
UPDATE cancel_intents
SET state = $3, result = $4, lease_until = NULL, lease_token = NULL, last_error_code = $5,
    updated_at = now()
WHERE attempt_id = $1 AND lease_token = $2 AND state = 'sending'
RETURNING attempt_id

-- name: submit_end_leases
-- Intents whose outcome the database kept the submitter from writing (aivedio.db.leases): their
-- lease ends now and the next claim takes them as a lapsed 'sending' intent (the create may
-- exist: same key again, or unknown). Fenced by each intent's token. $1 attempt ids  $2 tokens
UPDATE submit_intents i SET lease_until = now(), updated_at = now()
FROM unnest($1::uuid[], $2::uuid[]) AS l (id, token)
WHERE i.attempt_id = l.id AND i.lease_token = l.token AND i.state = 'sending'

-- name: cancel_end_leases
-- Cancels whose outcome the database kept the cancel worker from writing (aivedio.db.leases):
-- their lease ends now and the next claim sends the cancel again (a cancel is idempotent at the
-- provider). Fenced by each intent's token. $1 attempt ids  $2 tokens
UPDATE cancel_intents c SET lease_until = now(), updated_at = now()
FROM unnest($1::uuid[], $2::uuid[]) AS l (id, token)
WHERE c.attempt_id = l.id AND c.lease_token = l.token AND c.state = 'sending'
