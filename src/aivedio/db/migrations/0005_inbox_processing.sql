-- Inbox processor (issue 3, item 4): a claim lease and a redacted error sample per inbox row.
--   lease_until        a claimed row is held by one processor until then; a crashed processor's
--                      rows become claimable again when it passes
--   lease_token        the claimer's token: every later write of the row is fenced by it, so a
--                      processor whose lease was taken over cannot apply the row a second time
--   last_error_sample  a short, REDACTED sample of a payload the adapter could not normalize
-- and a partial index for `aivedio inbox dead-letters`.
ALTER TABLE provider_callback_inbox
    ADD COLUMN lease_until       TIMESTAMPTZ,
    ADD COLUMN lease_token       UUID,
    ADD COLUMN last_error_sample TEXT;

CREATE INDEX idx_callback_inbox_dead ON provider_callback_inbox (id)
    WHERE process_status = 'dead';
