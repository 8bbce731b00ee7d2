"""The pure core: statuses, observations and the transition decision. No I/O imports here."""
