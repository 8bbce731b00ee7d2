"""The notification gateway: SSE and WebSocket connections fed from Redis Pub/Sub (one
broadcast channel, or a channel per node with project -> node routes: ``routing.py``).

Exact resume from PostgreSQL, gap repair, tail checks, heartbeats on a shared wheel, bounded
per-connection queues and slow-client eviction. See docs/explanation/realtime-gateway.md.
"""

from aivedio.gateway.auth import StreamTokens, stream_token_routes
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.gateway import Gateway

__all__ = [
    "CloseReason",
    "Gateway",
    "GatewayConfig",
    "StreamTokens",
    "stream_token_routes",
]
