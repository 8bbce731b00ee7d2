"""The HTTP API (public contract in DESIGN.md)."""
