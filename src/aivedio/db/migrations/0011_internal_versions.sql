-- Public events only on public change (issue 13, item 4).
--
-- A task version whose public fields equal the previous ones (an internal status change such as
-- submitted -> provider_queued) takes no stream seq and writes no task event; the audit row that
-- records it is an observation_audit row with outcome 'applied' (reason 'no_public_change').
ALTER TABLE observation_audit DROP CONSTRAINT ck_audit_outcome;
ALTER TABLE observation_audit
    ADD CONSTRAINT ck_audit_outcome CHECK (outcome IN ('ignored', 'conflict', 'applied'));
