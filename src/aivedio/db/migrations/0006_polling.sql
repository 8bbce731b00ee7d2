-- Poller (issue 4 items 2-3): what the scheduler keeps per attempt beyond next_poll_at,
-- poll_failures and poll_lease_until (migration 0001).
--   poll_lease_token   fences a claim: only the replica holding it writes the result back
--   poll_unchanged     consecutive polls that taught nothing new (the n of min(cap, base*2^n))
--   poll_interval_s    the nominal interval last chosen (its inverse is the attempt's poll demand,
--                      summed to stretch every interval to what the rate limits allow)
--   poll_started_at    first claim: about when the provider accepted the job (404 grace,
--                      expected maximum duration)
--   polled_at          the last query
--   poll_error         the last query's failure class (NULL after a success)
--   poll_error_sample  the last malformed answer, redacted and short
-- and a partial index on what the claim scans: in-flight attempts only (NULL once finished).
ALTER TABLE task_attempts
    ADD COLUMN poll_lease_token  UUID,
    ADD COLUMN poll_unchanged    INTEGER     NOT NULL DEFAULT 0,
    ADD COLUMN poll_interval_s   REAL,
    ADD COLUMN poll_started_at   TIMESTAMPTZ,
    ADD COLUMN polled_at         TIMESTAMPTZ,
    ADD COLUMN poll_error        TEXT,
    ADD COLUMN poll_error_sample TEXT;

CREATE INDEX idx_attempts_poll_due ON task_attempts (next_poll_at)
    WHERE next_poll_at IS NOT NULL AND provider_task_id IS NOT NULL;
