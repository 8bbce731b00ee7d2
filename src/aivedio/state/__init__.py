"""The state service: the only writer of task state."""
