"""The process that runs roles: what a role contributes (``parts``), the supervisor that keeps its
loops running (``supervisor``, with the pure backoff of ``restart``), and their health (``health``)
as ``/readyz`` reports it.

Role modules import these at module level; nothing in this package imports a role module, so
there is no cycle.
"""
