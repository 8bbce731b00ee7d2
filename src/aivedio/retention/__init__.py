"""Data that lives for months: task_events partitions, retention with stream floors, outbox and
inbox purges, epochs (docs/explanation/retention.md)."""
