-- The inbox claim (queries/inbox.sql, inbox_claim) reads due rows in id order. The index it had,
-- (next_retry_at, id) over unprocessed rows, cannot give that order, so the planner walked the
-- primary key and filtered out every processed row: a claim cost grew with the table (2.4 ms
-- with 17,000 processed rows, 17 ms per claim under a backlog in `bench e2e` at 1,000/s), and
-- processed rows stay for the dedup window. Over the unprocessed rows in id order, a claim reads
-- only those, skipping the ones another processor holds and retries not yet due.
-- (A plain CREATE INDEX: migrations run in a transaction; it blocks inbox inserts while it
-- builds, which on a large inbox means seconds of 503 answers the providers retry.)
DROP INDEX idx_callback_inbox_pending;

CREATE INDEX idx_callback_inbox_due ON provider_callback_inbox (id)
    WHERE process_status IN ('pending', 'retry', 'orphan');
