-- name: outbox_claim
-- The relay's next batch: due pending rows, oldest first, locked until the relay's transaction
-- ends (rows another relay holds are skipped). Only the OLDEST pending row of each aggregate is
-- claimable, so a task's version N+1 is never in flight before version N was acked, whatever the
-- number of relays: a row locked by another relay is still pending, so it blocks its successors.
-- A row waiting for its retry (next_retry_at in the future) blocks them too.
-- $1 batch size
SELECT o.id, o.aggregate_id, o.aggregate_version, o.event_type, o.retry_count, o.created_at,
       o.payload::text AS payload, o.payload->>'trace_id' AS trace_id
FROM outbox_events o
WHERE o.publish_status = 'pending'
  AND (o.next_retry_at IS NULL OR o.next_retry_at <= now())
  AND NOT EXISTS (
      SELECT 1 FROM outbox_events p
      WHERE p.aggregate_id = o.aggregate_id
        AND p.publish_status = 'pending'
        AND p.id < o.id
        AND p.aggregate_type = o.aggregate_type)
ORDER BY o.id
LIMIT $1
FOR UPDATE OF o SKIP LOCKED

-- name: outbox_has_work
-- Is there a row outbox_claim could return (ignoring locks)? The relay's re-check before it sleeps.
SELECT EXISTS (
    SELECT 1 FROM outbox_events o
    WHERE o.publish_status = 'pending'
      AND (o.next_retry_at IS NULL OR o.next_retry_at <= now())
      AND NOT EXISTS (
          SELECT 1 FROM outbox_events p
          WHERE p.aggregate_id = o.aggregate_id
            AND p.publish_status = 'pending'
            AND p.id < o.id
            AND p.aggregate_type = o.aggregate_type))

-- name: outbox_mark_published
-- The broker acked these rows (or already had them: a duplicate).
-- $1 ids
UPDATE outbox_events
SET publish_status = 'published', published_at = now(), next_retry_at = NULL
WHERE id = ANY($1::bigint[])

-- name: outbox_mark_failed
-- Publishing failed: try again after a delay; a row that keeps being rejected becomes 'dead'
-- (it stops blocking its successors; see docs/explanation/propagation.md).
-- $1 ids  $2 delays in seconds  $3 dead?
UPDATE outbox_events o
SET retry_count = o.retry_count + 1,
    next_retry_at = now() + make_interval(secs => f.delay_s),
    publish_status = CASE WHEN f.dead THEN 'dead' ELSE 'pending' END
FROM unnest($1::bigint[], $2::float8[], $3::boolean[]) AS f(id, delay_s, dead)
WHERE o.id = f.id

-- name: outbox_stats
-- For the backlog gauges.
SELECT count(*) AS backlog,
       COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age_s
FROM outbox_events
WHERE publish_status = 'pending'
