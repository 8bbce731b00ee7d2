"""The message bus: a narrow port (``port.py``) and adapters (``jetstream.py``, ``memory.py``)."""

from aivedio.bus.port import (
    Bus,
    BusClosed,
    BusConfig,
    BusError,
    BusUnavailable,
    Consumer,
    DeadLetter,
    Delivery,
    OutgoingMessage,
    PublishAck,
)

__all__ = [
    "Bus",
    "BusClosed",
    "BusConfig",
    "BusError",
    "BusUnavailable",
    "Consumer",
    "DeadLetter",
    "Delivery",
    "OutgoingMessage",
    "PublishAck",
]
