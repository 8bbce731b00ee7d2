-- The declared schema: what a database migrated to the newest version must equal (the test
-- tests/integration/test_schema.py compares the catalog of both). Edit with a new migration.

CREATE TABLE tenants (
    id          UUID        PRIMARY KEY,
    name        TEXT        NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT uq_tenant_name UNIQUE (name)
);

CREATE TABLE projects (
    id          UUID        PRIMARY KEY,
    tenant_id   UUID        NOT NULL REFERENCES tenants (id),
    name        TEXT        NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT uq_project_name UNIQUE (tenant_id, name)
);

-- Keys are 256-bit random secrets: a SHA-256 digest is enough to store them (no slow hash needed).
CREATE TABLE api_keys (
    id          UUID        PRIMARY KEY,
    tenant_id   UUID        NOT NULL REFERENCES tenants (id),
    user_id     UUID        NOT NULL,
    key_prefix  TEXT        NOT NULL,
    key_hash    BYTEA       NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at  TIMESTAMPTZ,
    CONSTRAINT uq_api_key_hash UNIQUE (key_hash)
);

-- One row per project: events take head + 1 inside the state change's transaction, so seqs are
-- contiguous and commit-ordered. A cursor of another epoch, ahead of head or below floor resets.
CREATE TABLE event_streams (
    project_id  UUID        PRIMARY KEY REFERENCES projects (id),
    epoch       BIGINT      NOT NULL,
    head        BIGINT      NOT NULL DEFAULT 0,
    floor       BIGINT      NOT NULL DEFAULT 0,
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT ck_stream_floor CHECK (floor >= 0 AND floor <= head)
);

CREATE TABLE generation_tasks (
    id                  UUID        PRIMARY KEY,
    tenant_id           UUID        NOT NULL REFERENCES tenants (id),
    project_id          UUID        NOT NULL REFERENCES projects (id),
    user_id             UUID        NOT NULL,
    provider            TEXT        NOT NULL,
    model               TEXT        NOT NULL,
    prompt              TEXT        NOT NULL,
    params              JSONB       NOT NULL DEFAULT '{}'::jsonb,
    status              TEXT        NOT NULL,
    stage               TEXT        NOT NULL,
    progress            SMALLINT,
    version             BIGINT      NOT NULL DEFAULT 0,
    last_event_id       BIGINT,
    current_attempt_id  UUID,
    error_code          TEXT,
    error_message       TEXT,
    asset_id            UUID,
    progress_event_at   TIMESTAMPTZ,
    terminal_at         TIMESTAMPTZ,
    trace_id            TEXT,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT ck_task_status CHECK (status IN (
        'created', 'submit_unknown', 'submitted', 'provider_queued', 'running', 'status_unknown',
        'cancel_requested', 'provider_succeeded', 'processing_media', 'ready', 'failed', 'canceled')),
    CONSTRAINT ck_task_progress CHECK (progress BETWEEN 0 AND 100),
    CONSTRAINT ck_task_version CHECK (version >= 0)
);

CREATE INDEX idx_tasks_project_created ON generation_tasks (project_id, created_at DESC, id DESC);

CREATE TABLE task_attempts (
    id                  UUID        PRIMARY KEY,
    task_id             UUID        NOT NULL REFERENCES generation_tasks (id),
    attempt_no          INTEGER     NOT NULL,
    provider            TEXT        NOT NULL,
    model               TEXT        NOT NULL,
    client_request_id   TEXT        NOT NULL,
    provider_task_id    TEXT,
    provider_status     TEXT,
    last_provider_seq   BIGINT,
    last_provider_at    TIMESTAMPTZ,
    next_poll_at        TIMESTAMPTZ,
    poll_failures       INTEGER     NOT NULL DEFAULT 0,
    poll_lease_until    TIMESTAMPTZ,
    reason              TEXT,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT uq_task_attempt_no UNIQUE (task_id, attempt_no),
    CONSTRAINT uq_provider_task UNIQUE (provider, provider_task_id),
    CONSTRAINT uq_client_request UNIQUE (provider, client_request_id),
    CONSTRAINT ck_attempt_provider_status CHECK (provider_status IN (
        'queued', 'running', 'succeeded', 'failed', 'canceled'))
);

ALTER TABLE generation_tasks
    ADD CONSTRAINT fk_task_current_attempt FOREIGN KEY (current_attempt_id)
    REFERENCES task_attempts (id) DEFERRABLE INITIALLY DEFERRED;

CREATE TABLE provider_callback_inbox (
    id                    BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider              TEXT        NOT NULL,
    dedup_key             TEXT        NOT NULL,
    provider_event_id     TEXT,
    provider_task_id      TEXT,
    client_request_id     TEXT,
    provider_occurred_at  TIMESTAMPTZ,
    received_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    signature_key_version TEXT,
    payload_hash          BYTEA       NOT NULL,
    payload               JSONB,
    process_status        TEXT        NOT NULL DEFAULT 'pending',
    retry_count           INTEGER     NOT NULL DEFAULT 0,
    next_retry_at         TIMESTAMPTZ,
    last_error_code       TEXT,
    processed_at          TIMESTAMPTZ,
    trace_id              TEXT,
    event_type            TEXT,
    attempt_id            TEXT,
    payload_authenticated BOOLEAN     NOT NULL DEFAULT true,
    lease_until           TIMESTAMPTZ,
    lease_token           UUID,
    last_error_sample     TEXT,
    CONSTRAINT uq_provider_callback_dedup UNIQUE (provider, dedup_key),
    CONSTRAINT ck_inbox_status CHECK (process_status IN (
        'pending', 'retry', 'processed', 'orphan', 'dead'))
);

-- Due rows in id order for inbox_claim (migration 0015).
CREATE INDEX idx_callback_inbox_due ON provider_callback_inbox (id)
    WHERE process_status IN ('pending', 'retry', 'orphan');

CREATE INDEX idx_callback_inbox_retention ON provider_callback_inbox (processed_at)
    WHERE process_status = 'processed' AND payload IS NOT NULL;

-- Dead letters, for `aivedio inbox dead-letters` (migration 0005).
CREATE INDEX idx_callback_inbox_dead ON provider_callback_inbox (id)
    WHERE process_status = 'dead';

-- Wakes an idle inbox processor (LISTEN aivedio_inbox); notifies only while a processor holds
-- advisory lock 1229865560, see migrations 0003 and 0009, and only for rows not stored leased
-- (handed to a processor in memory: migration 0018).
CREATE FUNCTION aivedio_inbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows WHERE lease_token IS NULL)
       AND NOT pg_try_advisory_xact_lock_shared(1229865560) THEN
        PERFORM pg_notify('aivedio_inbox', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER trg_inbox_notify AFTER INSERT ON provider_callback_inbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_inbox_notify();

-- The inbox claim (queries/inbox.sql): due rows by a plain index scan, found again by primary
-- key; migration 0017 says why the planner may not choose a bitmap or a sequential scan here.
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

-- Partitioned by day (migration 0012, which says why the keys are what they are); the
-- partitions are made by aivedio_ensure_event_partitions and dropped by retention. Only what
-- its readers read (migration 0016 says what went where).
CREATE TABLE task_events (
    project_id      UUID        NOT NULL,
    epoch           BIGINT      NOT NULL,
    seq             BIGINT      NOT NULL,
    task_id         UUID        NOT NULL,
    task_version    BIGINT      NOT NULL,
    public_payload  JSON        NOT NULL,   -- state.events.stored_payload (migration 0016)
    source          TEXT        NOT NULL,
    trace_id        BYTEA,                  -- the bytes of trc_<hex> (aivedio.logs)
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT pk_task_events PRIMARY KEY (project_id, epoch, seq, created_at)
) PARTITION BY RANGE (created_at);

CREATE INDEX idx_task_events_task ON task_events (task_id, task_version);

-- Creates the daily partitions [day, day + 1) (UTC) from today through today + ahead_days that
-- do not exist yet; returns how many it created. A day that overlaps an existing partition (the
-- legacy one) is skipped. CREATE TABLE + ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE on
-- task_events, which blocks no writer and no reader (CREATE TABLE ... PARTITION OF would take
-- ACCESS EXCLUSIVE).
CREATE FUNCTION aivedio_ensure_event_partitions(ahead_days integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    part text;
    made integer := 0;
BEGIN
    FOR offset_days IN 0 .. ahead_days LOOP
        day := today + offset_days;
        part := 'task_events_p' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
            WHERE i.inhparent = 'task_events'::regclass AND c.relname = 'task_events_legacy'
              AND (day::timestamp AT TIME ZONE 'UTC') < (
                  SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]
                  )::timestamptz);
        EXECUTE format('CREATE TABLE %I (LIKE task_events INCLUDING DEFAULTS)', part);
        EXECUTE format(
            'ALTER TABLE task_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
            part, day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;

SELECT aivedio_ensure_event_partitions(7);

CREATE TABLE outbox_events (
    id                  BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type      TEXT        NOT NULL,
    aggregate_id        UUID        NOT NULL,
    aggregate_version   BIGINT      NOT NULL,
    event_type          TEXT        NOT NULL,
    payload             JSONB       NOT NULL,
    publish_status      TEXT        NOT NULL DEFAULT 'pending',
    retry_count         INTEGER     NOT NULL DEFAULT 0,
    next_retry_at       TIMESTAMPTZ,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at        TIMESTAMPTZ,
    CONSTRAINT uq_outbox_aggregate_version
        UNIQUE (aggregate_type, aggregate_id, aggregate_version, event_type),
    CONSTRAINT ck_outbox_status CHECK (publish_status IN ('pending', 'published', 'dead'))
);

CREATE INDEX idx_outbox_pending ON outbox_events (id) WHERE publish_status = 'pending';

-- A task's older pending rows, for the relay's in-order claim (migration 0003).
CREATE INDEX idx_outbox_pending_aggregate ON outbox_events (aggregate_id, id)
    WHERE publish_status = 'pending';

-- Wakes an idle outbox relay (LISTEN aivedio_outbox); notifies only while a relay holds advisory
-- lock 1330992194, see migration 0003 for why; not for a writer that kicks the relay of its own
-- process in memory and says so (migration 0018).
CREATE FUNCTION aivedio_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('aivedio.relay_kicked', true) IS DISTINCT FROM 'on'
       AND NOT pg_try_advisory_xact_lock_shared(1330992194) THEN
        PERFORM pg_notify('aivedio_outbox', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER trg_outbox_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION aivedio_outbox_notify();

-- Observations that changed nothing (ignored) or contradicted a terminal (conflict).
CREATE TABLE observation_audit (
    id                  BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id             UUID,
    attempt_id          UUID,
    project_id          UUID,
    outcome             TEXT        NOT NULL,
    reason              TEXT        NOT NULL,
    source              TEXT        NOT NULL,
    provider            TEXT,
    observed            TEXT        NOT NULL,
    provider_sequence   BIGINT,
    progress            SMALLINT,
    task_version        BIGINT,
    inbox_id            BIGINT,
    dedup_key           TEXT,
    trace_id            TEXT,
    received_at         TIMESTAMPTZ NOT NULL,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT ck_audit_outcome CHECK (outcome IN ('ignored', 'conflict', 'applied'))
);

CREATE INDEX idx_observation_audit_task ON observation_audit (task_id, id);

CREATE TABLE reconciliation_items (
    id            BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind          TEXT        NOT NULL,
    task_id       UUID        NOT NULL REFERENCES generation_tasks (id),
    attempt_id    UUID        NOT NULL REFERENCES task_attempts (id),
    project_id    UUID        NOT NULL,
    state         TEXT        NOT NULL DEFAULT 'open',
    detail        JSONB       NOT NULL DEFAULT '{}'::jsonb,
    resolution    TEXT,
    resolved_by   TEXT,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    resolved_at   TIMESTAMPTZ,
    CONSTRAINT ck_reconciliation_state CHECK (state IN ('open', 'resolved'))
);

-- One open item per (kind, attempt): a duplicated contradiction does not open a second one.
CREATE UNIQUE INDEX uq_reconciliation_open ON reconciliation_items (kind, attempt_id)
    WHERE state = 'open';

CREATE TABLE idempotency_keys (
    project_id    UUID        NOT NULL REFERENCES projects (id),
    key           TEXT        NOT NULL,
    request_hash  BYTEA       NOT NULL,
    task_id       UUID        NOT NULL REFERENCES generation_tasks (id) DEFERRABLE INITIALLY DEFERRED,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at    TIMESTAMPTZ NOT NULL,
    CONSTRAINT pk_idempotency_keys PRIMARY KEY (project_id, key)
);

-- Media operations, assets and the credit ledger (migration 0004); see the migration for notes.
CREATE TABLE media_operations (
    id               UUID        PRIMARY KEY,
    task_id          UUID        NOT NULL REFERENCES generation_tasks (id),
    attempt_id       UUID        NOT NULL REFERENCES task_attempts (id),
    project_id       UUID        NOT NULL REFERENCES projects (id),
    tenant_id        UUID        NOT NULL REFERENCES tenants (id),
    operation_type   TEXT        NOT NULL,
    state            TEXT        NOT NULL DEFAULT 'pending',
    stage            TEXT,
    tries            INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_until      TIMESTAMPTZ,
    lease_token      UUID,
    asset_id         UUID        NOT NULL,
    source_ref       TEXT,
    error_code       TEXT,
    error_detail     TEXT,
    trace_id         TEXT,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at      TIMESTAMPTZ,
    CONSTRAINT uq_media_operation UNIQUE (task_id, attempt_id, operation_type),
    CONSTRAINT ck_media_operation_state CHECK (state IN ('pending', 'running', 'succeeded', 'failed')),
    CONSTRAINT ck_media_operation_tries CHECK (tries >= 0)
);

CREATE INDEX idx_media_operations_due ON media_operations (next_attempt_at)
    WHERE state = 'pending';

CREATE INDEX idx_media_operations_lease ON media_operations (lease_until)
    WHERE state = 'running';

-- A published, playable rendition. One per (task, attempt): a second publish is a no-op.
CREATE TABLE assets (
    id            UUID             PRIMARY KEY,
    task_id       UUID             NOT NULL REFERENCES generation_tasks (id),
    attempt_id    UUID             NOT NULL REFERENCES task_attempts (id),
    project_id    UUID             NOT NULL REFERENCES projects (id),
    tenant_id     UUID             NOT NULL REFERENCES tenants (id),
    storage_key   TEXT             NOT NULL,
    original_key  TEXT,
    content_type  TEXT             NOT NULL,
    size_bytes    BIGINT           NOT NULL,
    duration_s    DOUBLE PRECISION,
    width         INTEGER,
    height        INTEGER,
    codec         TEXT             NOT NULL,
    created_at    TIMESTAMPTZ      NOT NULL DEFAULT now(),
    CONSTRAINT uq_asset_attempt UNIQUE (task_id, attempt_id),
    CONSTRAINT ck_asset_size CHECK (size_bytes >= 0)
);

-- The billing ledger: one row per (task, attempt, ledger_type), so a redelivered bus message
-- never writes a second one; at most one closing entry (settle or refund) per attempt.
-- Amounts are whole credits, never negative; the sign comes from ledger_type.
CREATE TABLE credit_ledger (
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       UUID        NOT NULL REFERENCES tenants (id),
    project_id      UUID        NOT NULL REFERENCES projects (id),
    task_id         UUID        NOT NULL REFERENCES generation_tasks (id),
    attempt_id      UUID        NOT NULL REFERENCES task_attempts (id),
    ledger_type     TEXT        NOT NULL,
    amount          BIGINT      NOT NULL,
    provider        TEXT        NOT NULL,
    model           TEXT        NOT NULL,
    task_version    BIGINT,
    trace_id        TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT uq_credit_ledger_business_key UNIQUE (task_id, attempt_id, ledger_type),
    CONSTRAINT ck_credit_ledger_type CHECK (ledger_type IN ('reserve', 'settle', 'refund')),
    CONSTRAINT ck_credit_ledger_amount CHECK (amount >= 0)
);

CREATE UNIQUE INDEX uq_credit_ledger_closing ON credit_ledger (task_id, attempt_id)
    WHERE ledger_type IN ('settle', 'refund');

CREATE INDEX idx_credit_ledger_tenant ON credit_ledger (tenant_id, created_at);

-- Per tenant: reserved = every hold ever placed; settled = holds turned into charges (ready);
-- refunded = holds released (failed / canceled). held = reserved - settled - refunded is what is
-- on hold for attempts still in flight; spent = settled is what the tenant was charged.
CREATE VIEW tenant_credit_balances AS
SELECT tenant_id,
       COALESCE(sum(amount) FILTER (WHERE ledger_type = 'reserve'), 0)::bigint AS reserved,
       COALESCE(sum(amount) FILTER (WHERE ledger_type = 'settle'), 0)::bigint AS settled,
       COALESCE(sum(amount) FILTER (WHERE ledger_type = 'refund'), 0)::bigint AS refunded,
       (COALESCE(sum(amount) FILTER (WHERE ledger_type = 'reserve'), 0)
        - COALESCE(sum(amount) FILTER (WHERE ledger_type IN ('settle', 'refund')), 0))::bigint
           AS held,
       COALESCE(sum(amount) FILTER (WHERE ledger_type = 'settle'), 0)::bigint AS spent,
       count(*) AS entries
FROM credit_ledger
GROUP BY tenant_id;

-- Submit / cancel intents and reconcile checks (migration 0007); see the migration for notes.
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

-- Poller bookkeeping on attempts and the due index (migration 0006); see the migration for notes.
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

-- Browser sessions (migration 0008); see the migration for notes.
CREATE TABLE browser_sessions (
    id           UUID        PRIMARY KEY,
    secret_hash  BYTEA       NOT NULL,
    tenant_id    UUID        NOT NULL REFERENCES tenants (id),
    user_id      UUID        NOT NULL,
    project_id   UUID        REFERENCES projects (id),
    key_id       UUID        NOT NULL REFERENCES api_keys (id),
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at   TIMESTAMPTZ NOT NULL,
    revoked_at   TIMESTAMPTZ,
    CONSTRAINT uq_browser_session_secret UNIQUE (secret_hash),
    CONSTRAINT ck_browser_session_expiry CHECK (expires_at > created_at)
);

CREATE INDEX idx_browser_sessions_key ON browser_sessions (key_id);
-- The reconciler deletes sessions some time after they expired (sessions_retention_s).
CREATE INDEX idx_browser_sessions_expiry ON browser_sessions (expires_at);
