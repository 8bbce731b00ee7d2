-- Browser sessions (issue 5, item 4): what the demo page, or any page, holds instead of an API key.
--
-- A browser exchanges an API key once (POST /v1/sessions) for an HttpOnly, SameSite=Strict cookie
-- `aivedio_session=<secret>`; only the SHA-256 digest of the 256-bit secret is stored, so a leak
-- of this table opens nothing (no slow hash needed for a random secret, as for api_keys).
--   project_id  the one project the session may use; NULL: every project of the tenant
--   key_id      the API key that created it: a session is valid only while its key is unrevoked
--               (the validity check joins api_keys), so revoking the key revokes its sessions
--   expires_at  a connection opened with the session lives at most until then (80-100 % jitter)
--   revoked_at  DELETE /v1/sessions/current; the gateway closes its streams within 5 s
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
