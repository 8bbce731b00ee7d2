"""Callback ingest: authenticity checks on raw webhook requests (more to come: inbox, processor)."""
