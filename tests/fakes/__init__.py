"""Fakes of ports for tests; each passes the same contract suite (``tests/contract``) as the
real adapters."""
