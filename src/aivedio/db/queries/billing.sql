-- name: billing_attempt
-- What a ledger entry needs beyond the event: the attempt's provider and model (for the price),
-- and the task's current status and attempt (to close a reservation that arrives late).
SELECT a.provider, a.model, t.status AS task_status, t.current_attempt_id
FROM task_attempts a
JOIN generation_tasks t ON t.id = a.task_id
WHERE a.id = $1 AND a.task_id = $2

-- name: insert_reserve
-- The hold placed when the provider accepted the attempt. A duplicate does nothing.
INSERT INTO credit_ledger (tenant_id, project_id, task_id, attempt_id, ledger_type, amount,
                           provider, model, task_version, trace_id)
VALUES ($1, $2, $3, $4, 'reserve', $5, $6, $7, $8, $9)
ON CONFLICT DO NOTHING
RETURNING id

-- name: insert_closing
-- Settle or refund exactly the reserved amount, only if there is a reservation; a duplicate,
-- or a second closing entry of the other kind, does nothing (unique business key and the
-- one-closing-entry index).
INSERT INTO credit_ledger (tenant_id, project_id, task_id, attempt_id, ledger_type, amount,
                           provider, model, task_version, trace_id)
SELECT r.tenant_id, r.project_id, r.task_id, r.attempt_id, $3, r.amount,
       r.provider, r.model, $4, $5
FROM credit_ledger r
WHERE r.task_id = $1 AND r.attempt_id = $2 AND r.ledger_type = 'reserve'
ON CONFLICT DO NOTHING
RETURNING id, amount

-- name: tenant_balance
SELECT tenant_id, reserved, settled, refunded, held, spent, entries
FROM tenant_credit_balances WHERE tenant_id = $1

-- name: ledger_of_task
SELECT id, tenant_id, project_id, task_id, attempt_id, ledger_type, amount, provider, model,
       task_version, trace_id, created_at
FROM credit_ledger WHERE task_id = $1 ORDER BY id
