-- name: key_caller
-- The caller behind an unrevoked API key (by the SHA-256 digest of the key).
SELECT id, tenant_id, user_id FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL

-- name: insert_browser_session
INSERT INTO browser_sessions (id, secret_hash, tenant_id, user_id, project_id, key_id, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))
RETURNING created_at, expires_at

-- name: live_browser_session
-- A session that is unexpired, unrevoked, and whose API key is unrevoked.
SELECT s.id, s.tenant_id, s.user_id, s.project_id, s.key_id, s.created_at, s.expires_at
FROM browser_sessions s JOIN api_keys k ON k.id = s.key_id
WHERE s.secret_hash = $1 AND s.revoked_at IS NULL AND s.expires_at > now()
  AND k.revoked_at IS NULL

-- name: revoke_browser_session
UPDATE browser_sessions SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL

-- name: revoked_credentials
-- Of these credential ids (API keys and browser sessions), the ones revoked since: a session
-- counts as revoked when its API key is.
SELECT id FROM api_keys WHERE id = ANY($1::uuid[]) AND revoked_at IS NOT NULL
UNION ALL
SELECT s.id FROM browser_sessions s JOIN api_keys k ON k.id = s.key_id
WHERE s.id = ANY($1::uuid[]) AND (s.revoked_at IS NOT NULL OR k.revoked_at IS NOT NULL)
