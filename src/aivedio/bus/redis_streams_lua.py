"""The Lua scripts of the Redis Streams bus: publish with dedup, and delayed redelivery.

:data:`PUBLISH` checks the dedup key, XADDs (trimmed by age) and sets the dedup key at once, so
a duplicate never reaches the stream.

Delayed redelivery (``nak(delay)`` with a delay past the ack wait): a Redis stream entry that
stays pending is claimed by ``XAUTOCLAIM`` once idle for the ack wait, and its idle time cannot
be set below zero, so an entry left pending cannot wait longer than the ack wait. A longer nak
therefore takes the entry out of the group's pending list and parks it, per group and topic:

* ``z:{group}:{topic}`` - a sorted set of parked tokens, scored by the due time (Redis ``TIME``,
  milliseconds, so every process agrees on the clock);
* ``zd:{group}:{topic}`` - a hash holding each parked message's fields under ``{token}/{name}``
  (sequence, topic, key, dedup id, headers, payload) and ``{token}/n``, its deliveries so far.

:data:`NAK_LATER` does the ``XACK`` of the nak-ed entry, the parking and the delivery-count
clean-up in one script, so a process dying between them loses nothing and double-schedules
nothing (an entry no longer pending is not parked: ``XACK`` returned 0). Every fetch first runs
:data:`MOVE_DUE`, which re-adds the due messages to the group's own replay stream (the one
replayed dead letters use, read with the topic's stream: the other groups, which saw the
message already, do not get it again), carrying the delivery count over to the new entry id,
and says when the next parked message is due so the fetch does not block past it. The re-add
is an ``XADD`` outside the publish script, so publish dedup by id never swallows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MOVE_DUE", "NAK_LATER", "PUBLISH", "nak_later_args"]

# KEYS: stream, dedup key, seq key. ARGV: dedup window ms, retention ms, then the fields.
PUBLISH = """
local seen = redis.call('GET', KEYS[2])
if seen then return {seen, 1} end
local seq = redis.call('INCR', KEYS[3])
local now = redis.call('TIME')
local oldest = (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)) - tonumber(ARGV[2])
if oldest < 0 then oldest = 0 end
redis.call('XADD', KEYS[1], 'MINID', '~', oldest, '*',
  'q', seq, 't', ARGV[3], 'k', ARGV[4], 'd', ARGV[5], 'h', ARGV[6], 'p', ARGV[7])
redis.call('SET', KEYS[2], seq, 'PX', ARGV[1])
return {tostring(seq), 0}
"""

# KEYS: source stream, parked zset, parked data hash, delivery counts hash.
# ARGV: group, entry id, token, delay ms, deliveries, q, t, k, d, h, p.
NAK_LATER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HDEL', KEYS[4], ARGV[2])
local now = redis.call('TIME')
local due = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[4])
local t = ARGV[3]
redis.call('HSET', KEYS[3], t .. '/n', ARGV[5], t .. '/q', ARGV[6], t .. '/t', ARGV[7],
  t .. '/k', ARGV[8], t .. '/d', ARGV[9], t .. '/h', ARGV[10], t .. '/p', ARGV[11])
redis.call('ZADD', KEYS[2], due, t)
return 1
"""

# KEYS: parked zset, parked data hash, delivery counts hash, the group's replay stream.
# ARGV: how many to move at most, retention ms.
# Returns ms until the next parked message is due (<= 0: due now), -1 if none is parked.
MOVE_DUE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local oldest = now_ms - tonumber(ARGV[2])
if oldest < 0 then oldest = 0 end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
local names = {'n', 'q', 't', 'k', 'd', 'h', 'p'}
for _, t in ipairs(due) do
  local f = {}
  for i, name in ipairs(names) do f[i] = t .. '/' .. name end
  local v = redis.call('HMGET', KEYS[2], unpack(f))
  if v[3] then
    local id = redis.call('XADD', KEYS[4], 'MINID', '~', oldest, '*',
      'q', v[2], 't', v[3], 'k', v[4], 'd', v[5], 'h', v[6], 'p', v[7])
    redis.call('HSET', KEYS[3], id, v[1])
  end
  redis.call('HDEL', KEYS[2], unpack(f))
  redis.call('ZREM', KEYS[1], t)
end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if nxt[2] then return tonumber(nxt[2]) - now_ms end
return -1
"""


def nak_later_args(
    group: str,
    entry_id: str,
    token: str,
    delay_s: float,
    deliveries: int,
    fields: Mapping[bytes, bytes],
) -> list[Any]:
    """ARGV of :data:`NAK_LATER` for one delivered entry."""
    return [
        group,
        entry_id,
        token,
        max(0, int(delay_s * 1000)),
        deliveries,
        fields.get(b"q", b"0"),
        fields[b"t"],
        fields[b"k"],
        fields[b"d"],
        fields[b"h"],
        fields[b"p"],
    ]
