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
-- later observations of a task. Each task is one probe of its primary key (LATERAL ... LIMIT 1):
-- as a join, the planner hashed a seq scan of generation_tasks while the table was small
-- (issue 11: 177 of 621 calls in `bench e2e` at 500/s, each reading every task and its dead
-- versions).
SELECT t.id, t.tenant_id, t.project_id, t.user_id, t.status, t.stage, t.progress, t.version,
       t.current_attempt_id, t.progress_event_at, t.error_code, t.error_message, t.asset_id,
       a.id AS attempt_id, a.provider_status, a.last_provider_seq, a.last_provider_at,
       now() AS locked_at
FROM task_attempts a
CROSS JOIN LATERAL (
    SELECT t.* FROM generation_tasks t WHERE t.id = a.task_id LIMIT 1
) t
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
-- A version that is not a public event ($21 false: it changes no public field) takes no seq and
-- inserts no task event; its outbox row has event_id and epoch null, and its audit row
-- (observation_audit, outcome 'applied') is written instead. Always returns one row.
-- The event's stored payload ($5, state.events.stored_payload) leaves out what its columns
-- already say (task_id, task_version, event_id = seq) and null fields: readers add them back
-- (domain.public.stored_event, gateway.frames.make_event). Its trace id is stored as bytes
-- (migration 0016).
-- $1 project  $2 task  $3 attempt  $4 new version  $5 stored payload  $6 source
-- $7 trace  $8 status  $9 stage  $10 progress  $11 error_code
-- $12 error_message  $13 asset  $14 terminal  $15 domain payload  $16 record attempt?
-- $17 provider_status  $18 last_provider_seq  $19 last_provider_at  $20 inbox id
-- $21 public event?  audit row (when not): $22 reason  $23 observed  $24 received_at
-- $25 provider  $26 provider_sequence  $27 progress  $28 dedup key
-- $29 the outbox row's event_type, its routing class (state.events)
WITH stream AS (
    UPDATE event_streams SET head = head + 1, updated_at = now()
    WHERE project_id = $1 AND $21::boolean
    RETURNING epoch, head
), event AS (
    INSERT INTO task_events (project_id, epoch, seq, task_id, task_version, public_payload,
                             source, trace_id, created_at)
    SELECT $1, stream.epoch, stream.head, $2, $4, $5::text::json, $6,
           CASE WHEN $7 ~ '^trc_([0-9a-f]{2})+$' THEN decode(substr($7, 5), 'hex') END,
           clock_timestamp()  -- written after the stream lock: just before the commit
    FROM stream
), task AS (
    UPDATE generation_tasks
    SET status = $8, stage = $9, progress = $10, version = $4,
        last_event_id = COALESCE((SELECT head FROM stream), last_event_id),
        error_code = $11, error_message = $12, asset_id = $13,
        -- the last event of the stage: a version that is not an event keeps it
        progress_event_at = CASE WHEN $21::boolean THEN now() ELSE progress_event_at END,
        terminal_at = CASE WHEN $14::boolean THEN now() END,
        trace_id = COALESCE($7, trace_id),
        updated_at = now()
    WHERE id = $2 AND version = $4 - 1
    RETURNING id
), attempt AS (
    -- A webhook that changed something pushes the attempt's next poll out to the poller's
    -- WEBHOOK_PUSH_S once it is due within WEBHOOK_PUSH_DUE_S (aivedio.polling.policy; a test
    -- keeps the figures equal); a finished task's attempt is not polled again. Left alone
    -- otherwise, next_poll_at (indexed) stays as it is, so most webhooks' attempt updates are
    -- HOT: no new entry in any of task_attempts' five indexes.
    UPDATE task_attempts
    SET provider_status = $17, last_provider_seq = $18, last_provider_at = $19, updated_at = now(),
        next_poll_at = CASE
            WHEN $14::boolean THEN NULL
            WHEN $6 = 'webhook' AND next_poll_at < now() + interval '15 seconds'
                THEN now() + interval '30 seconds'
            ELSE next_poll_at
        END
    WHERE id = $3 AND $16::boolean
    RETURNING id
), outbox AS (
    INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
    SELECT 'task', $2, $4, $29,
           $15::jsonb || jsonb_build_object('event_id', (SELECT head FROM stream),
                                            'epoch', (SELECT epoch FROM stream))
), audit AS (
    INSERT INTO observation_audit (task_id, attempt_id, project_id, outcome, reason, source,
                                   provider, observed, provider_sequence, progress,
                                   task_version, inbox_id, dedup_key, trace_id, received_at)
    SELECT $2, $3, $1, 'applied', $22, $6, $25, $23, $26, $27, $4, $20, $28, $7, $24
    WHERE NOT $21::boolean
), inbox AS (
    UPDATE provider_callback_inbox
    SET process_status = 'processed', processed_at = now()
    WHERE id = $20
      AND process_status <> 'processed'  -- the inbox processor marked it first
    RETURNING id
)
SELECT (SELECT epoch FROM stream) AS epoch, (SELECT head FROM stream) AS head,
       (SELECT count(*) FROM task) AS tasks_updated

-- name: record_unapplied
-- Observations that changed nothing, any number in one statement (one round trip for a batch's
-- stale and ignored ones, where a statement each made an overloaded processor slower still):
-- element i of every array is one observation, in decided order. Each gets its audit row, what
-- it taught us about the attempt (an attempt named by several takes the last one's values), its
-- reconciliation item (conflicts, stale-attempt results; one open item per kind and attempt) and
-- its inbox row marked processed.
-- $1 task[]  $2 attempt[]  $3 project[]  $4 outcome[]  $5 reason[]  $6 source[]  $7 provider[]
-- $8 observed[]  $9 provider_sequence[]  $10 progress[]  $11 task_version[]  $12 inbox id[]
-- $13 dedup key[]  $14 trace[]  $15 received_at[]  $16 record attempt?[]  $17 provider_status[]
-- $18 last_provider_seq[]  $19 last_provider_at[]  $20 reconciliation kind[]
-- $21 reconciliation detail[] (JSON text)
WITH input AS MATERIALIZED (
    SELECT *
    FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::text[], $5::text[], $6::text[],
                $7::text[], $8::text[], $9::bigint[], $10::smallint[], $11::bigint[],
                $12::bigint[], $13::text[], $14::text[], $15::timestamptz[], $16::boolean[],
                $17::text[], $18::bigint[], $19::timestamptz[], $20::text[], $21::text[])
        WITH ORDINALITY AS i (task_id, attempt_id, project_id, outcome, reason, source,
                              provider, observed, provider_sequence, progress, task_version,
                              inbox_id, dedup_key, trace_id, received_at, record_attempt,
                              provider_status, last_provider_seq, last_provider_at, kind,
                              detail, ord)
), audit AS (
    INSERT INTO observation_audit (task_id, attempt_id, project_id, outcome, reason, source,
                                   provider, observed, provider_sequence, progress,
                                   task_version, inbox_id, dedup_key, trace_id, received_at)
    SELECT task_id, attempt_id, project_id, outcome, reason, source, provider, observed,
           provider_sequence, progress, task_version, inbox_id, dedup_key, trace_id, received_at
    FROM input
    ORDER BY ord
    RETURNING id
), attempt AS (
    UPDATE task_attempts a
    SET provider_status = l.provider_status, last_provider_seq = l.last_provider_seq,
        last_provider_at = l.last_provider_at, updated_at = now()
    FROM (SELECT DISTINCT ON (attempt_id) *
          FROM input
          WHERE record_attempt AND attempt_id IS NOT NULL
          ORDER BY attempt_id, ord DESC) l
    WHERE a.id = l.attempt_id
    RETURNING a.id
), item AS (
    INSERT INTO reconciliation_items (kind, task_id, attempt_id, project_id, detail)
    SELECT kind, task_id, attempt_id, project_id, detail::jsonb
    FROM input
    WHERE kind IS NOT NULL
    ORDER BY ord
    ON CONFLICT (kind, attempt_id) WHERE state = 'open' DO NOTHING
    RETURNING id
), inbox AS (
    UPDATE provider_callback_inbox
    SET process_status = 'processed', processed_at = now()
    WHERE id = ANY (ARRAY(SELECT inbox_id FROM input WHERE inbox_id IS NOT NULL))
      AND process_status <> 'processed'  -- the inbox processor marked it first
    RETURNING id
)
SELECT (SELECT count(*) FROM audit) AS audits, (SELECT count(*) FROM attempt) AS attempts,
       (SELECT count(*) FROM item) AS items, (SELECT count(*) FROM inbox) AS inbox

-- name: write_events
-- apply_many: write_event for a batch of events in one statement, one round trip. Element i of
-- every array is one event; the events come in write order (by project, then in the order they
-- were decided), and each one is exactly what write_event would write for it in that order:
-- - the stream rows of the batch's projects are locked in project id order (the locked CTE is
--   materialized, and the stream UPDATE only touches rows it produced), so two batches cannot
--   deadlock on them; each head moves by the project's public event count and public events
--   are numbered from the old head, contiguous and in order;
-- - a version that is not a public event ($21 false) takes no seq and no task event: its
--   outbox row has event_id and epoch null and its audit row is written instead (write_event);
-- - a task with several events ends as its last one left it (version CAS on the first one's
--   version - 1, last_event_id its last public seq, the last non-NULL trace id);
-- - an attempt takes the provider fields of its last event (the caller passes the batch's final
--   values there) and next_poll_at as write_event's CASE applied event after event would leave
--   it (any terminal: NULL; else any webhook: out to 30 seconds once due within 15).
-- Returns one row per event, in order (seq and epoch null for a version that is not public).
-- Rows of existing tables are found by their primary key from arrays of the batch's ids
-- (= ANY (ARRAY(...))): as joins with the input, the planner hashed seq scans of
-- generation_tasks and the inbox while they were small, each reading every row and its dead
-- versions (issue 11: 1,673 scans of generation_tasks in 10 s at 500/s in `bench e2e`, 6 with
-- the ANY). It stays the planner's choice by cost: a generic plan may still scan a table of a
-- few hundred rows, and a one-page event_streams is scanned, which costs nothing.
-- $1 project[]  $2 task[]  $3 attempt[]  $4 new version[]  $5 stored payload[]
-- $6 source[]  $7 trace[]  $8 status[]  $9 stage[]  $10 progress[]
-- $11 error_code[]  $12 error_message[]  $13 asset[]  $14 terminal[]  $15 domain payload[]
-- $16 record attempt?[]  $17 provider_status[]  $18 last_provider_seq[]  $19 last_provider_at[]
-- $20 inbox id[]  $21 public event?[]  audit rows: $22 reason[]  $23 observed[]
-- $24 received_at[]  $25 provider[]  $26 provider_sequence[]  $27 progress[]  $28 dedup key[]
-- $29 the outbox rows' event_type[] (state.events)
WITH input AS MATERIALIZED (
    SELECT *
    FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::bigint[], $5::text[],
                $6::text[], $7::text[], $8::text[], $9::text[],
                $10::smallint[], $11::text[], $12::text[], $13::uuid[], $14::boolean[],
                $15::text[], $16::boolean[], $17::text[], $18::bigint[], $19::timestamptz[],
                $20::bigint[], $21::boolean[], $22::text[], $23::text[], $24::timestamptz[],
                $25::text[], $26::bigint[], $27::smallint[], $28::text[], $29::text[])
        WITH ORDINALITY AS i (project_id, task_id, attempt_id, version, public_payload,
                              source, trace_id, status, stage, progress, error_code,
                              error_message, asset_id, terminal, payload, record_attempt,
                              provider_status, last_provider_seq, last_provider_at, inbox_id,
                              public, audit_reason, audit_observed, audit_received_at,
                              audit_provider, audit_provider_sequence, audit_progress,
                              audit_dedup_key, event_type, ord)
), locked AS MATERIALIZED (
    SELECT project_id FROM event_streams
    WHERE project_id = ANY (ARRAY(SELECT project_id FROM input WHERE public))
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
    INSERT INTO task_events (project_id, epoch, seq, task_id, task_version, public_payload,
                             source, trace_id, created_at)
    SELECT project_id, epoch, seq, task_id, version, public_payload::json, source,
           CASE WHEN trace_id ~ '^trc_([0-9a-f]{2})+$' THEN decode(substr(trace_id, 5), 'hex') END,
           clock_timestamp()
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
    WHERE t.id = ANY (ARRAY(SELECT task_id FROM per_task))
      AND t.id = e.task_id AND t.version = p.first_version - 1
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
            WHEN p.any_webhook AND a.next_poll_at < now() + interval '15 seconds'
                THEN now() + interval '30 seconds'
            ELSE a.next_poll_at
        END
    FROM per_attempt p
    WHERE a.id = p.attempt_id
    RETURNING a.id
), outbox AS (
    INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
    SELECT 'task', task_id, version, event_type,
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
    WHERE id = ANY (ARRAY(SELECT inbox_id FROM input WHERE inbox_id IS NOT NULL))
      AND process_status <> 'processed'  -- the inbox processor marked it first
    RETURNING id
)
SELECT ord, epoch, seq, (SELECT count(*) FROM task) AS tasks_updated,
       (SELECT count(DISTINCT task_id) FROM input) AS tasks
FROM numbered
ORDER BY ord
