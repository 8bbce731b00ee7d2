-- name: inbox_claim
-- Claim up to $1 due rows for $2 seconds under lease token $3. SKIP LOCKED: concurrent
-- processors take disjoint rows; a row whose lease passed (its processor died) is due again.
-- $1 batch size  $2 lease seconds  $3 lease token
-- aivedio_inbox_claim (migration 0017 says why it is a function) locks, leases and returns them.
SELECT id, provider, dedup_key, provider_event_id, provider_task_id, client_request_id,
       provider_occurred_at, received_at, payload, process_status, retry_count, event_type,
       attempt_id, payload_authenticated, trace_id
FROM aivedio_inbox_claim($1, $2, $3)

-- name: inbox_take_claimed
-- The first statement of the apply transaction, for the rows ($1 ids) of one transaction and the
-- attempts ($3 uuid[], one per row, NULL for none) they are to be applied to: the rows still ours
-- (token $2) and unprocessed, locked in id order (two processors cannot deadlock on them) and
-- marked processed (lease dropped); then the tasks of those rows' attempts locked in task id
-- order, as lock_tasks_for_attempts does (state.sql): the state service's locked_attempts reads
-- them in the next statement, the one that must follow the lock (see lock_task_for_attempt).
-- One statement, one round trip, where a take and a lock were two. The transaction commits it
-- with the rows' effects or rolls it all back. A row another processor took over is not returned,
-- and its task is not locked. (The state service's own inbox update then finds the rows
-- processed and writes nothing more.) $4 'on' when the processor's process will kick its outbox
-- relay after the commit: the transaction's outbox rows then send no NOTIFY (migration 0018);
-- set for the transaction, once a row is taken (nothing is written otherwise).
WITH mine AS (
    SELECT id FROM provider_callback_inbox
    WHERE id = ANY($1::bigint[]) AND lease_token = $2
      AND process_status IN ('pending', 'retry', 'orphan')
    ORDER BY id
    FOR UPDATE
), taken AS (
    UPDATE provider_callback_inbox i
    SET process_status = 'processed', processed_at = COALESCE(i.processed_at, now()),
        lease_until = NULL, lease_token = NULL
    FROM mine
    WHERE i.id = mine.id
    RETURNING i.id
), tasks AS MATERIALIZED (
    SELECT t.id FROM generation_tasks t
    WHERE t.id IN (
        SELECT a.task_id
        FROM unnest($1::bigint[], $3::uuid[]) AS k (inbox_id, attempt_id)
        JOIN taken ON taken.id = k.inbox_id
        JOIN task_attempts a ON a.id = k.attempt_id)
    ORDER BY t.id
    FOR UPDATE OF t
)
-- tasks_locked is read by no caller: a WITH query that nothing references is never run, so
-- the SELECT names it to take the task locks (tested: without it, no task is locked).
SELECT taken.id, (SELECT count(*) FROM tasks) AS tasks_locked,
       (SELECT set_config('aivedio.relay_kicked', $4::text, true)) AS relay_kicked
FROM taken

-- name: inbox_release
-- A stopping processor gives back the leases of the rows handed to it in memory that it never
-- took (aivedio.db.handoff): claimable at once rather than when the lease runs out. Fenced by
-- the token. $1 ids  $2 lease token
UPDATE provider_callback_inbox SET lease_until = NULL, lease_token = NULL
WHERE id = ANY($1::bigint[]) AND lease_token = $2
  AND process_status IN ('pending', 'retry', 'orphan')

-- name: inbox_defer
-- Not processed this time: orphan (unmappable) or retry (parse / refetch failure) after a
-- backoff, or dead once it has been tried $4 times. Fenced by the lease token.
-- $1 id  $2 token  $3 'orphan' | 'retry'  $4 max tries  $5 delay seconds  $6 error code
-- $7 redacted sample (NULL keeps the previous one)
UPDATE provider_callback_inbox
SET retry_count = retry_count + 1,
    process_status = CASE WHEN retry_count + 1 >= $4 THEN 'dead' ELSE $3 END,
    next_retry_at = CASE WHEN retry_count + 1 >= $4 THEN NULL
                         ELSE now() + make_interval(secs => $5) END,
    last_error_code = $6,
    last_error_sample = COALESCE($7, last_error_sample),
    lease_until = NULL, lease_token = NULL
WHERE id = $1 AND lease_token = $2 AND process_status IN ('pending', 'retry', 'orphan')
RETURNING process_status, retry_count

-- name: attempts_for_callbacks
-- Every attempt the rows of one claim may belong to, in one statement (one round trip per claim,
-- not per row): by attempt id ($1), by (provider, provider task id) ($2, $3), by (provider,
-- client request id) ($4, $5), each by its unique index, with the task's project. The processor
-- resolves each row from these: attempt id first, then provider task id, then client request id.
-- Each key is one probe of its index (LATERAL ... LIMIT 1; as joins, the planner hashed a seq
-- scan of task_attempts twice per claim while the table was small: 1 ms per claim of 43 rows
-- in `bench e2e` with 1,000 tasks), and a client request id is not looked up when its attempt
-- was found by provider task id already (it could only find that attempt again).
WITH by_task AS (
    SELECT a.id, a.provider, a.client_request_id, a.provider_task_id, a.task_id
    FROM unnest($2::text[], $3::text[]) AS k (provider, provider_task_id)
    CROSS JOIN LATERAL (
        SELECT a.id, a.provider, a.client_request_id, a.provider_task_id, a.task_id
        FROM task_attempts a
        WHERE a.provider = k.provider AND a.provider_task_id = k.provider_task_id
        LIMIT 1
    ) a
), by_request AS (
    SELECT a.id, a.provider, a.client_request_id, a.provider_task_id, a.task_id
    FROM unnest($4::text[], $5::text[]) AS k (provider, client_request_id)
    CROSS JOIN LATERAL (
        SELECT a.id, a.provider, a.client_request_id, a.provider_task_id, a.task_id
        FROM task_attempts a
        WHERE a.provider = k.provider AND a.client_request_id = k.client_request_id
        LIMIT 1
    ) a
    WHERE NOT EXISTS (
        SELECT 1 FROM by_task b
        WHERE b.provider = k.provider AND b.client_request_id = k.client_request_id)
), found AS (
    SELECT a.id, a.provider, a.client_request_id, a.provider_task_id, a.task_id
    FROM task_attempts a WHERE a.id = ANY($1::uuid[])
    UNION
    SELECT * FROM by_task
    UNION
    SELECT * FROM by_request
)
SELECT f.id, f.provider, f.client_request_id, f.provider_task_id, t.project_id
FROM found f
CROSS JOIN LATERAL (
    SELECT t.project_id FROM generation_tasks t WHERE t.id = f.task_id LIMIT 1
) t  -- one probe of the primary key per attempt, for the same reason (generation_tasks)

-- name: attempt_record_provider_task_ids
-- Callbacks that arrived before the submit response taught attempts ($1) their provider's ids
-- ($2). Such a callback names the attempt's client_request_id and is authentic: the provider
-- accepted the submit. So the attempt is also scheduled for polling (the submitter does it when
-- the response comes, which may be never: the submit may have failed after the provider
-- accepted it, and a task that moved on from `created` is not submitted again), and its intent,
-- if still waiting for a retry, is accepted. SKIP LOCKED on the intent: a submitter that holds
-- it settles it itself, and the lock order (intent before task) forbids waiting for it here.
WITH taught AS (
    UPDATE task_attempts AS a
    SET provider_task_id = v.provider_task_id,
        next_poll_at = COALESCE(a.next_poll_at, now() + interval '30 seconds'),
        updated_at = now()
    FROM unnest($1::uuid[], $2::text[]) AS v (id, provider_task_id)
    WHERE a.id = v.id AND a.provider_task_id IS NULL
    RETURNING a.id
), waiting AS (
    SELECT i.attempt_id FROM submit_intents i
    WHERE i.attempt_id IN (SELECT id FROM taught) AND i.state = 'pending'
    FOR UPDATE SKIP LOCKED
)
UPDATE submit_intents i
SET state = 'accepted', lease_until = NULL, lease_token = NULL, last_error_code = NULL,
    updated_at = now()
FROM waiting
WHERE i.attempt_id = waiting.attempt_id

-- name: inbox_dead_letters
SELECT id, provider, dedup_key, provider_task_id, client_request_id, event_type, received_at,
       retry_count, last_error_code, last_error_sample, trace_id
FROM provider_callback_inbox
WHERE process_status = 'dead'
ORDER BY id DESC
LIMIT $1

-- name: inbox_replay
-- Requeue one row now, with a fresh try budget. A processed row is left alone.
UPDATE provider_callback_inbox
SET process_status = 'pending', retry_count = 0, next_retry_at = NULL,
    lease_until = NULL, lease_token = NULL
WHERE id = $1 AND process_status IN ('dead', 'orphan', 'retry')
RETURNING id

-- name: inbox_has_work
-- Could inbox_claim return a row now (ignoring row locks)? The processor's re-check before it
-- sleeps (aivedio/db/wakeup.py).
SELECT EXISTS (
    SELECT 1 FROM provider_callback_inbox
    WHERE process_status IN ('pending', 'retry', 'orphan')
      AND (next_retry_at IS NULL OR next_retry_at <= now())
      AND (lease_until IS NULL OR lease_until < now())
)

-- name: inbox_end_leases
-- Rows whose processing the database interrupted (aivedio.db.leases): claimable at once rather
-- than when their lease runs out. Fenced by each row's token. $1 ids  $2 lease tokens
UPDATE provider_callback_inbox i SET lease_until = NULL, lease_token = NULL
FROM unnest($1::bigint[], $2::uuid[]) AS l (id, token)
WHERE i.id = l.id AND i.lease_token = l.token
  AND i.process_status IN ('pending', 'retry', 'orphan')
