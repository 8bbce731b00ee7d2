"""Fan-out: a narrow port (``port.py``) and adapters (``redis.py``, ``memory.py``)."""

from aivedio.fanout.port import (
    FanoutError,
    FanoutPublisher,
    FanoutSubscriber,
    FanoutUnavailable,
    Message,
    Subscribed,
    Subscription,
)

__all__ = [
    "FanoutError",
    "FanoutPublisher",
    "FanoutSubscriber",
    "FanoutUnavailable",
    "Message",
    "Subscribed",
    "Subscription",
]
