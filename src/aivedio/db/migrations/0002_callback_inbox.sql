-- Callback gateway (issue 3): what the gateway learns at the door and the processor needs.
--   event_type             the provider's event type ("generation.updated"), when the body names one
--   attempt_id             the attempt a callback token authenticated (unsigned providers only)
--   payload_authenticated  false when only the URL was authenticated (callback token): the
--                          processor re-fetches the job from the provider before changing state
-- and a partial index for the retention sweep that nulls the payload of processed rows.
ALTER TABLE provider_callback_inbox
    ADD COLUMN event_type            TEXT,
    ADD COLUMN attempt_id            TEXT,
    ADD COLUMN payload_authenticated BOOLEAN NOT NULL DEFAULT true;

CREATE INDEX idx_callback_inbox_retention ON provider_callback_inbox (processed_at)
    WHERE process_status = 'processed' AND payload IS NOT NULL;
