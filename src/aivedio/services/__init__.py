"""Embedded servers for machines without PostgreSQL, NATS or Redis."""
