"""The Lua scripts that keep the Redis queue between gateway and workers consistent: each
runs atomically in Redis. The keys and entry fields they touch are named in
`pagedserve.common.queue_protocol`, which also exports these scripts to both sides (the
gateway runs them through redis.asyncio, the worker through redis).

Requests wait in one stream per tenant (`queue_protocol.requests_key`); the set of those
streams is `queue_protocol.TENANTS`. A stream entry lives from admission until its final
outcome (the owner's ack deletes it), so a tenant stream's length is that tenant's number of
requests in flight: queued or running.
"""

from __future__ import annotations

#: Admission: one atomic "is there a live worker, room in the queue and room in the
#: tenant's limits? then XADD to the tenant's stream".
#: KEYS: tenant stream, queued, queued_tokens, workers, admitted marker of this request,
#: tenants set, tenant tokens hash. ARGV: max_queued, max_queued_tokens, prompt tokens,
#: message, tenant max in flight, tenant max queued tokens, marker ttl (seconds).
#: Returns {1, entry id}, {1, "again"} (a retry of an admitted request: nothing more is
#: queued), or {0, reason} with reason one of "no_worker", "full", "tenant_requests",
#: "tenant_tokens". The entry's fields are queue_protocol.REQUEST_FIELD ('m': the message)
#: and PROMPT_TOKENS_FIELD ('t': its prompt tokens).
#: A single request larger than a token bound is let in when nothing of its kind is queued,
#: or it could never run; the gateway bounds prompt sizes on its own.
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
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[5]) then return {0, 'tenant_requests'} end
local tenant_tokens = tonumber(redis.call('HGET', KEYS[7], KEYS[1]) or '0')
if tenant_tokens > 0 and tenant_tokens + n > tonumber(ARGV[6]) then return {0, 'tenant_tokens'} end
redis.pcall('XGROUP', 'CREATE', KEYS[1], 'workers', '0', 'MKSTREAM')
redis.call('SADD', KEYS[6], KEYS[1])
redis.call('INCR', KEYS[2])
redis.call('INCRBY', KEYS[3], n)
redis.call('HINCRBY', KEYS[7], KEYS[1], n)
redis.call('SET', KEYS[5], 1, 'EX', ARGV[7])
return {1, redis.call('XADD', KEYS[1], '*', 'm', ARGV[4], 't', ARGV[3])}
"""

#: A worker took requests: count them out of the queue. KEYS: queued, queued_tokens, tenant
#: tokens hash. ARGV: number of requests, their prompt tokens, then pairs (tenant stream,
#: its prompt tokens taken). Never below zero (a Redis restart resets the counters). Allowed
#: when Redis is full (it frees memory): the entries are read already and must be counted.
TAKEN = """#!lua flags=allow-oom
for i = 1, 2 do
  local v = redis.call('DECRBY', KEYS[i], ARGV[i])
  if v < 0 then redis.call('SET', KEYS[i], 0) end
end
for i = 3, #ARGV, 2 do
  if redis.call('HINCRBY', KEYS[3], ARGV[i], -tonumber(ARGV[i + 1])) <= 0 then
    redis.call('HDEL', KEYS[3], ARGV[i])
  end
end
return 1
"""

#: Final outcome: acknowledge and delete the entry, but only while this worker owns it
#: (a worker wrongly thought dead must not ack what another worker now runs).
#: KEYS: the entry's tenant stream. ARGV: group, consumer, entry id. Returns 1 if acknowledged.
ACK_IF_OWNER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""

#: Heartbeat: announce the worker, and touch every entry it runs (XCLAIM JUSTID to itself
#: resets the idle time without counting a delivery) so XAUTOCLAIM only ever takes entries
#: of workers that stopped beating. Each running request's admitted marker is renewed: it
#: tells the gateway the request still exists somewhere, also after Redis restarted empty
#: (then the entry is gone but the worker keeps writing the output the gateway reads).
#: Entries another worker has taken are returned, as (stream, entry id) pairs flattened:
#: the caller aborts them.
#: KEYS: workers, worker info key. ARGV: group, consumer, ttl in milliseconds, info, marker
#: ttl in seconds, then triples (tenant stream, entry id, admitted marker key). Allowed when
#: Redis is full: its writes are small and bounded, and without it every worker looks dead.
HEARTBEAT = """#!lua flags=allow-oom
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local ttl_ms = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], t + ttl_ms / 1000, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t - 3600)
redis.call('SET', KEYS[2], ARGV[4], 'PX', ttl_ms)
local lost = {}
for i = 6, #ARGV, 3 do
  local ok, p = pcall(redis.call, 'XPENDING', ARGV[i], ARGV[1], ARGV[i + 1], ARGV[i + 1], 1)
  if ok and p[1] ~= nil and p[1][2] ~= ARGV[2] then
    table.insert(lost, ARGV[i])
    table.insert(lost, ARGV[i + 1])
  else
    if ok and p[1] ~= nil then
      redis.call('XCLAIM', ARGV[i], ARGV[1], ARGV[2], 0, ARGV[i + 1], 'JUSTID')
    end
    redis.call('SET', ARGV[i + 2], 1, 'EX', ARGV[5])
  end
end
return lost
"""

#: Reconcile the queue's counters with the streams themselves, so they cannot drift (a
#: worker that died between reading and counting, a Redis restart): the queued requests
#: and tokens are the entries no worker has read yet, in every tenant stream. A tenant
#: stream with nothing in flight leaves the tenants set. KEYS: tenants set, queued,
#: queued_tokens, tenant tokens hash. ARGV: group. Returns {queued, queued tokens}.
RECONCILE = """
local queued, tokens = 0, 0
redis.call('DEL', KEYS[4])
for _, stream in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('XLEN', stream) == 0 then
    redis.call('SREM', KEYS[1], stream)
  else
    local last = '0-0'
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
    if ok then
      for _, g in ipairs(groups) do
        local info = {}
        for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
        if info['name'] == ARGV[1] then last = info['last-delivered-id'] end
      end
    end
    local stream_tokens = 0
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last, '+')) do
      queued = queued + 1
      local fields = entry[2]
      for i = 1, #fields, 2 do
        if fields[i] == 't' then stream_tokens = stream_tokens + tonumber(fields[i + 1]) end
      end
    end
    if stream_tokens > 0 then redis.call('HSET', KEYS[4], stream, stream_tokens) end
    tokens = tokens + stream_tokens
  end
end
redis.call('SET', KEYS[2], queued)
redis.call('SET', KEYS[3], tokens)
return {queued, tokens}
"""
