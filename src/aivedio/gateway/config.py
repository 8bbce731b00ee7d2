"""The gateway's configuration (built by the CLI from ``Settings``; no environment reads here)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from aivedio.channels import DEFAULT_PREFIX, GATEWAY_KEY_PREFIX, INTEREST_PREFIX, broadcast_channel
from aivedio.config import Settings


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str
    channel: str = broadcast_channel()  # the broadcast channel the dispatcher publishes to
    key_prefix: str = GATEWAY_KEY_PREFIX  # Redis keys of the connection counters
    token_secret: bytes = b""  # HMAC key of stream tokens (>= 32 random bytes in production)
    heartbeat_s: float = 20.0  # `: ping` comment interval, below proxy idle timeouts
    retry_ms: int = 2000  # the `retry:` hint sent on connect
    session_cap_s: float = 1800.0  # a connection lives 80-100 % of this, then reconnects
    # Credentials are re-checked (revocation) at this interval; below 5 s so that a revoked
    # credential's streams close within 5 s including the query itself.
    recheck_s: float = 4.0
    tailcheck_s: float = 5.0  # stream heads compared at this interval (and after a reconnect)
    tailcheck_grace_s: float = 0.5  # a head seen ahead is repaired if still ahead after this
    replay_cap: int = 1000  # a resume needing more events than this gets `reset`
    # A live seq ahead of the next one is held this long for the missing ones to arrive live
    # (relays and dispatchers in several processes reorder a project's events by a few ms)
    # before they are read from PostgreSQL; 0 reads at once.
    reorder_wait_s: float = 0.02
    replay_page: int = 500
    queue_max_events: int = 256  # per connection, while its socket is not writable
    queue_max_bytes: int = 256 * 1024
    stall_timeout_s: float = 30.0  # not writable for this long -> `slow`
    write_high_water: int = 32 * 1024  # asyncio transport buffer limits per connection
    write_low_water: int = 8 * 1024
    socket_send_buffer: int | None = None  # SO_SNDBUF per connection (None: the OS default)
    backlog_max_events: int = 10_000  # live events buffered while one connection replays
    max_head_bytes: int = 8192
    # Redis messages that had already arrived, delivered together with one write per
    # connection (hub.py, transport.corked); 1 turns the batching off.
    max_corked: int = 32
    head_timeout_s: float = 10.0
    max_conns_per_user: int = 50
    max_conns_per_tenant: int = 5000
    connect_rate_per_s: float = 2000.0  # token bucket of new SSE connections per process
    connect_burst: int = 4000
    drain_s: float = 5.0  # shutdown closes connections spread over this many seconds
    counter_ttl_factor: float = 2.0  # per-user/tenant counter TTL = factor * session cap
    # WebSocket: browsers' Origins allowed to upgrade (() = same origin as the Host header only;
    # the CLI should pass the public URL's origin, ``origin_of(public_url)``). A request without
    # Origin (not a browser) is allowed only with an API key, never with the cookie.
    ws_allowed_origins: tuple[str, ...] = ()
    ws_max_message: int = 4096  # incoming frame / reassembled message cap -> close 1009
    ws_close_timeout_s: float = 2.0  # after our close frame, wait this long for the client's
    # Fan-out (docs/explanation/realtime-gateway.md#fan-out): "broadcast" subscribes to
    # ``channel``; "node" subscribes only to ``<channel_prefix>:node:<node_id>`` and registers
    # project -> node routes in Redis for the dispatcher (gateway/routing.py).
    fanout: str = "broadcast"
    node_id: str = ""  # "" -> <host>-<pid>-<random>, unique per process start
    channel_prefix: str = DEFAULT_PREFIX  # the dispatcher's channel_prefix (node channels, routes)
    route_ttl_s: float = 30.0  # a route lapses this long after its node's last refresh
    route_check_delay_s: float = 1.0  # early tail check after a (re)registration
    interest_ttl_s: float = 30.0  # polling interest marks (aivedio.polling.ratelimit)
    interest_prefix: str = INTEREST_PREFIX
    redis_timeout_s: float = 2.0  # per Redis command of the gateway (not the subscription)
    # Diagnostic (AIVEDIO_GATEWAY_TIMING, off by default): each live SSE frame also carries a
    # comment line ``: timing <relayed> <dispatched> <written>`` (Unix times: the relay's
    # publish, the dispatcher's PUBLISH, this node's frame), for ``aivedio bench e2e``. Comments
    # are ignored by EventSource; the line holds only those numbers. Never on in production.
    timing: bool = False

    @classmethod
    def from_settings(cls, settings: Settings, redis_url: str) -> GatewayConfig:
        """The gateway's config from the process settings (the Redis URL as resolved)."""
        origins = tuple(
            o.strip().lower() for o in settings.ws_allowed_origins.split(",") if o.strip()
        )
        return cls(
            ws_allowed_origins=origins,
            redis_url=redis_url,
            channel=settings.gateway_channel,
            token_secret=settings.derived_secret("stream-tokens"),
            heartbeat_s=settings.gateway_heartbeat_s,
            session_cap_s=settings.gateway_session_cap_s,
            replay_cap=settings.gateway_replay_cap,
            tailcheck_s=settings.gateway_tailcheck_s,
            max_conns_per_user=settings.gateway_max_conns_per_user,
            max_conns_per_tenant=settings.gateway_max_conns_per_tenant,
            connect_rate_per_s=settings.gateway_connect_rate_per_s,
            timing=settings.gateway_timing,
            fanout=settings.fanout,
            node_id=settings.gateway_node_id,
        )


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of a URL, as browsers send it in ``Origin``."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()
