-- Media operations, assets, and the credit ledger (issue 6, items 4 and 5).

-- One row per (task, attempt, operation): the media consumer inserts it on provider_succeeded
-- (a duplicate delivery hits the UNIQUE and does nothing); media workers claim due rows with
-- FOR UPDATE SKIP LOCKED and hold them by a lease fenced by lease_token. source_ref names the
-- provider output ("sandbox:gen_123"), never a signed URL: workers ask the provider for a fresh
-- URL on every run. asset_id is chosen at insert so every retry writes the same keys.
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
