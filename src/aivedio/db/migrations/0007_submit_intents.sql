-- Submission, cancel and reconciliation bookkeeping (issue 4).
--
-- submit_intents: one row per attempt, written by the same statement that inserts the attempt
-- (tasks.sql insert_attempt), so "task + attempt + intent" is one transaction. A table of its own
-- rather than columns on task_attempts: the intent has its own lifecycle and lease, the poller's
-- hot row stays narrow, and the due-intent index only holds the few intents not yet resolved.
--   state        pending (due at next_attempt_at) -> sending (leased) -> accepted | unknown |
--                rejected | canceled (the cancel worker took a never-sent intent back)
--   maybe_sent   a create may have reached the provider (an unknown outcome was seen, or a lease
--                expired mid-send): never give up on such an intent without a lookup
--   unknown_at   when the outcome became unknown (the reconciler's lookup grace starts there)
--   next_attempt_at  the next send (pending) or the reconciler's next lookup (unknown)
CREATE TABLE submit_intents (
    attempt_id       UUID        PRIMARY KEY REFERENCES task_attempts (id),
    task_id          UUID        NOT NULL REFERENCES generation_tasks (id),
    state            TEXT        NOT NULL DEFAULT 'pending',
    tries            INTEGER     NOT NULL DEFAULT 0,
    maybe_sent       BOOLEAN     NOT NULL DEFAULT false,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_until      TIMESTAMPTZ,
    lease_token      UUID,
    last_error_code  TEXT,
    unknown_at       TIMESTAMPTZ,
    lookups          INTEGER     NOT NULL DEFAULT 0,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT ck_submit_intent_state CHECK (state IN (
        'pending', 'sending', 'accepted', 'unknown', 'rejected', 'canceled')),
    CONSTRAINT ck_submit_intent_tries CHECK (tries >= 0)
);

CREATE INDEX idx_submit_intents_due ON submit_intents (next_attempt_at)
    WHERE state IN ('pending', 'sending');

CREATE INDEX idx_submit_intents_unknown ON submit_intents (next_attempt_at)
    WHERE state = 'unknown';

-- cancel_intents: written with the cancel_requested version (tasks.sql insert_cancel_intent).
--   state   pending -> sending (leased) -> done (result: accepted | already_terminal | local |
--           moot) | failed (the provider refused the cancel; polling still finds the outcome)
CREATE TABLE cancel_intents (
    attempt_id       UUID        PRIMARY KEY REFERENCES task_attempts (id),
    task_id          UUID        NOT NULL REFERENCES generation_tasks (id),
    state            TEXT        NOT NULL DEFAULT 'pending',
    result           TEXT,
    tries            INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_until      TIMESTAMPTZ,
    lease_token      UUID,
    last_error_code  TEXT,
    trace_id         TEXT,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT ck_cancel_intent_state CHECK (state IN ('pending', 'sending', 'done', 'failed')),
    CONSTRAINT ck_cancel_intent_tries CHECK (tries >= 0)
);

CREATE INDEX idx_cancel_intents_due ON cancel_intents (next_attempt_at)
    WHERE state IN ('pending', 'sending');

-- When the reconciler last queried an overdue attempt (so it asks each one at most once per
-- check interval, whatever the number of replicas).
CREATE TABLE reconcile_checks (
    attempt_id   UUID        PRIMARY KEY REFERENCES task_attempts (id),
    checked_at   TIMESTAMPTZ NOT NULL,
    checks       INTEGER     NOT NULL DEFAULT 1,
    last_result  TEXT
);

-- Attempts that existed before this migration were submitted (or not) by hand: no intent would
-- be honest for those with a provider task id; the others get a pending one.
INSERT INTO submit_intents (attempt_id, task_id, state)
SELECT a.id, a.task_id, CASE WHEN a.provider_task_id IS NULL THEN 'pending' ELSE 'accepted' END
FROM task_attempts a;
