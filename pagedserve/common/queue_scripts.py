"""The Lua scripts that keep the Redis queue between gateway and workers consistent: each
runs atomically in Redis. The keys and entry fields they touch are named in
`pagedserve.common.queue_protocol`, which also exports these scripts to both sides (the
gateway runs them through redis.asyncio, the worker through redis).
"""

from __future__ import annotations

#: Admission: one atomic "is there a live worker and room in the queue? then XADD".
#: KEYS: requests, queued, queued_tokens, workers, admitted marker of this request. ARGV:
#: max_queued, max_queued_tokens, prompt tokens, message. Returns {1, entry id},
#: {1, "again"} (a retry of an admitted request: nothing more is queued), {0, "full"} or
#: {0, "no_worker"}. The entry's fields are queue_protocol.REQUEST_FIELD ('m': the message)
#: and PROMPT_TOKENS_FIELD ('t': its prompt tokens).
#: A single request larger than the token bound is let in when the queue is empty, or it
#: could never run; the gateway bounds prompt sizes on its own.
ADMIT = """
if redis.call('EXISTS', KEYS[5]) == 1 then return {1, 'again'} end
local now = redis.call('TIME')
if redis.call('ZCOUNT', KEYS[4], tonumber(now[1]) + tonumber(now[2]) / 1e6, '+inf') == 0 then
  return {0, 'no_worker'}
end
local queued = tonumber(redis.call('GET', KEYS[2]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
local n = tonumber(ARGV[3])
if queued >= tonumber(ARGV[1]) or (queued > 0 and tokens + n > tonumber(ARGV[2])) then
  return {0, 'full'}
end
redis.call('INCR', KEYS[2])
redis.call('INCRBY', KEYS[3], n)
redis.call('SET', KEYS[5], 1, 'EX', 600)
return {1, redis.call('XADD', KEYS[1], '*', 'm', ARGV[4], 't', ARGV[3])}
"""

#: A worker took requests: count them out of the queue. KEYS: queued, queued_tokens.
#: ARGV: number of requests, their prompt tokens. Never below zero (a Redis restart resets).
TAKEN = """
for i = 1, 2 do
  local v = redis.call('DECRBY', KEYS[i], ARGV[i])
  if v < 0 then redis.call('SET', KEYS[i], 0) end
end
return 1
"""

#: Final outcome: acknowledge and delete the entry, but only while this worker owns it
#: (a worker wrongly thought dead must not ack what another worker now runs).
#: KEYS: requests. ARGV: group, consumer, entry id. Returns 1 if acknowledged.
ACK_IF_OWNER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""

#: Heartbeat: announce the worker, and touch every entry it runs (XCLAIM JUSTID to itself
#: resets the idle time without counting a delivery) so XAUTOCLAIM only ever takes entries
#: of workers that stopped beating. Entries another worker has taken are returned: the
#: caller aborts them. Entries gone from the queue (Redis restarted empty) are not: their
#: worker keeps writing their output, which the gateway still reads.
#: KEYS: requests, workers, worker info key. ARGV: group, consumer, ttl in milliseconds, info,
#: entry ids...
HEARTBEAT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local ttl_ms = tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], t + ttl_ms / 1000, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t - 3600)
redis.call('SET', KEYS[3], ARGV[4], 'PX', ttl_ms)
local lost = {}
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] ~= nil then
    if p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      table.insert(lost, ARGV[i])
    end
  end
end
return lost
"""
