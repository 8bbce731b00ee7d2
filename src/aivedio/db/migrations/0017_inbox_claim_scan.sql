-- The inbox claim (queries/inbox.sql, inbox_claim) is this function: due rows by a plain index
-- scan of idx_callback_inbox_due, each then found by its primary key; the planner may not choose
-- a bitmap scan or a sequential scan for it.
--
-- Why: a processed row leaves its entry in the partial index until a vacuum. Estimating a
-- handful of due rows, the planner chose a bitmap scan, and a bitmap scan never marks such an
-- entry dead: every claim visited the heap for every row processed since the last vacuum (3,495
-- entries and 553 pages for 43 due rows, 1.35 ms per claim, in `bench e2e` at 1,000/s), and
-- autovacuum comes more rarely as the inbox grows (processed rows stay for the dedup window).
-- A plain index scan marks each entry whose row is dead to every transaction (kill_prior_tuple),
-- so the next claims step over it without reading the heap. On a young inbox whose statistics
-- still say it is small, the planner also hashed a sequential scan of the whole table to find
-- the claimed rows again (2.9 ms per claim). PL/pgSQL keeps the plan for the session.
CREATE FUNCTION aivedio_inbox_claim(batch integer, lease_s float8, token uuid)
RETURNS SETOF provider_callback_inbox
LANGUAGE plpgsql ROWS 10 SET enable_bitmapscan = off SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    WITH due AS (
        SELECT d.id FROM provider_callback_inbox d
        WHERE d.process_status IN ('pending', 'retry', 'orphan')
          AND (d.next_retry_at IS NULL OR d.next_retry_at <= now())
          AND (d.lease_until IS NULL OR d.lease_until < now())
        ORDER BY d.id
        LIMIT batch
        FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE provider_callback_inbox AS i
        SET lease_until = now() + make_interval(secs => lease_s), lease_token = token
        FROM due
        WHERE i.id = due.id
        RETURNING i.*
    )
    SELECT * FROM claimed;
END
$$;
