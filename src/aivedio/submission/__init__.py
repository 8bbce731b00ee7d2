"""Outbound commands to providers: the submitter, the cancel worker, the audited resubmit."""
