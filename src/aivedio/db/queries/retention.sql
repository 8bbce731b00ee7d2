-- name: ensure_event_partitions
-- Today's and the next $1 days' partitions of task_events (migration 0012); how many were made.
SELECT aivedio_ensure_event_partitions($1)

-- name: event_partitions
-- Every partition of task_events with its upper bound (NULL: MAXVALUE) and whether a
-- DETACH ... CONCURRENTLY of it was interrupted (it must be finalized before the drop).
SELECT c.relname AS name,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
           AS upper_bound,
       i.inhdetachpending AS detach_pending
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'task_events'::regclass
ORDER BY upper_bound NULLS LAST, name

-- name: stream_batch
-- A page of streams in project order, for raising floors a few rows per transaction.
SELECT project_id, epoch, floor FROM event_streams
WHERE project_id > $1
ORDER BY project_id
LIMIT $2

-- name: purge_outbox_batch
-- Published outbox rows older than $3, at most $2 of the rows after id $1 (walking the primary
-- key from the oldest: ids follow time closely enough that the walk stops at the first page
-- with a young row). Pending and dead rows stay. Returns the page's last id, how many were
-- deleted and whether a row younger than $3 was seen.
WITH page AS (
    SELECT id, published_at, created_at FROM outbox_events
    WHERE id > $1
    ORDER BY id
    LIMIT $2
), gone AS (
    DELETE FROM outbox_events o
    USING page p
    WHERE o.id = p.id AND o.publish_status = 'published' AND o.published_at < $3
    RETURNING o.id
)
SELECT (SELECT max(id) FROM page) AS last_id,
       (SELECT count(*) FROM gone) AS deleted,
       COALESCE((SELECT bool_or(created_at >= $3) FROM page), false) AS young

-- name: purge_inbox_batch
-- Processed callbacks received before $3 (the dedup window), at most $2 of the rows after id
-- $1, oldest first; a later duplicate of one is a new row that the state machine absorbs
-- (terminal absorption, sequence checks). Pending, retry, orphan and dead rows stay.
WITH page AS (
    SELECT id, received_at FROM provider_callback_inbox
    WHERE id > $1
    ORDER BY id
    LIMIT $2
), gone AS (
    DELETE FROM provider_callback_inbox i
    USING page p
    WHERE i.id = p.id AND i.process_status = 'processed' AND i.received_at < $3
    RETURNING i.id
)
SELECT (SELECT max(id) FROM page) AS last_id,
       (SELECT count(*) FROM gone) AS deleted,
       COALESCE((SELECT bool_or(received_at >= $3) FROM page), false) AS young

-- name: bump_epoch
-- A new epoch for the given streams (NULL: every stream): every cursor issued before gets
-- `reset`. The epoch is the time in ms, and at least one more than the old one, so it was never
-- handed out before (an epoch bumped in a history that a restore threw away was older). Seqs go
-- on from head (no seq is handed out twice in one epoch); floor = head: nothing of the new
-- epoch is stored yet, a cursor at head replays exactly.
UPDATE event_streams
SET epoch = GREATEST(epoch + 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint),
    floor = head, updated_at = now()
WHERE $1::uuid[] IS NULL OR project_id = ANY($1::uuid[])
RETURNING project_id, epoch, head

-- name: detached_event_tables
-- Tables a detach left behind: a round killed while its DETACH ... CONCURRENTLY waited leaves
-- the server to finish the detach, and the DROP never comes. Their streams' floors were raised
-- before the detach began, and nothing reads them: the next round drops them. (To keep a day,
-- rename its table before it is detached.)
SELECT c.relname AS name
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = current_schema() AND c.relkind = 'r' AND NOT c.relispartition
  AND c.relname ~ '^task_events_(p[0-9]{8}|legacy)$'
ORDER BY c.relname
