"""Polling compensation: the poll scheduler and workers, rate limits, pure policies.

- :mod:`~aivedio.polling.policy`: intervals, query-outcome rules, circuit breakers (pure).
- :mod:`~aivedio.polling.buckets`: token-bucket arithmetic (pure).
- :mod:`~aivedio.polling.ratelimit`: four-level buckets in Redis, local fallback, interest keys.
- :mod:`~aivedio.polling.poller`: claim, take tokens, query, apply, reschedule.
- :mod:`~aivedio.polling.role`: ``poller_role`` for ``aivedio run --role poller``.
"""
