"""The Lua scripts that keep the Redis queue between gateway and workers consistent: each
runs atomically in Redis. The keys and entry fields they touch are named in
`pagedserve.common.queue_protocol`, which also exports these scripts to both sides (the
gateway runs them through redis.asyncio, the worker through redis).

Requests wait in one stream per tenant (`queue_protocol.requests_key`), or in a stream per
worker and tenant when the gateway routed them (`queue_protocol.routed_key`); the set of
those streams is `queue_protocol.TENANTS`. A stream entry lives from admission until its final
outcome (the owner's ack deletes it), so a tenant stream's length is that tenant's number of
requests in flight: queued or running.
"""

from __future__ import annotations

#: Admission: one atomic "is there a live worker, room in the queue and room in the
#: tenant's limits? then XADD to the tenant's stream, or to the stream routed to a worker".
#: KEYS: tenant stream, queued, queued_tokens, workers, admitted marker of this request,
#: tenants set, tenant tokens hash, routed stream (the tenant stream when not routed),
#: tenant routed hash, worker tokens hash, worker queued hash. ARGV: max_queued, max_queued_tokens, prompt
#: tokens, message, tenant max in flight, tenant max queued tokens, marker ttl (seconds),
#: the worker routed to ("": none), the prompt tokens that worker holds cached (0: none),
#: "1" to admit while no worker is live (autoscaling from zero; absent or "0": refuse).
#: Returns {1, entry id, stream written}, {1, "again"} (a retry of an admitted request:
#: nothing more is queued), or {0, reason} with reason one of "no_worker", "full",
#: "tenant_requests", "tenant_tokens". A request routed to a worker that is no longer live
#: goes to the tenant stream instead. The entry's fields are queue_protocol.REQUEST_FIELD
#: ('m': the message) and PROMPT_TOKENS_FIELD ('t': its prompt tokens), and in a routed
#: stream CACHED_TOKENS_FIELD ('c': the prompt tokens its worker holds; STEAL weighs them).
#: A tenant's requests in flight are its tenant stream's entries plus its entries in routed
#: streams (tenant routed hash); its queued tokens count both.
#: A single request larger than a token bound is let in when nothing of its kind is queued,
#: or it could never run; the gateway bounds prompt sizes on its own.
ADMIT = """
if redis.call('EXISTS', KEYS[5]) == 1 then return {1, 'again'} end
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
if ARGV[10] ~= '1' and redis.call('ZCOUNT', KEYS[4], t, '+inf') == 0 then
  return {0, 'no_worker'}
end
local queued = tonumber(redis.call('GET', KEYS[2]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
local n = tonumber(ARGV[3])
if queued >= tonumber(ARGV[1]) or (queued > 0 and tokens + n > tonumber(ARGV[2])) then
  return {0, 'full'}
end
local in_flight = redis.call('XLEN', KEYS[1]) + tonumber(redis.call('HGET', KEYS[9], KEYS[1]) or '0')
if in_flight >= tonumber(ARGV[5]) then return {0, 'tenant_requests'} end
local tenant_tokens = tonumber(redis.call('HGET', KEYS[7], KEYS[1]) or '0')
if tenant_tokens > 0 and tenant_tokens + n > tonumber(ARGV[6]) then return {0, 'tenant_tokens'} end
local stream = KEYS[1]
local routed = false
if ARGV[8] ~= '' and tonumber(redis.call('ZSCORE', KEYS[4], ARGV[8]) or '0') >= t then
  stream = KEYS[8]
  routed = true
  redis.call('HINCRBY', KEYS[9], KEYS[1], 1)
  redis.call('HINCRBY', KEYS[10], ARGV[8], n)
  redis.call('HINCRBY', KEYS[11], ARGV[8], 1)
end
redis.pcall('XGROUP', 'CREATE', stream, 'workers', '0', 'MKSTREAM')
redis.call('SADD', KEYS[6], stream)
redis.call('INCR', KEYS[2])
redis.call('INCRBY', KEYS[3], n)
redis.call('HINCRBY', KEYS[7], KEYS[1], n)
redis.call('SET', KEYS[5], 1, 'EX', ARGV[7])
if routed then
  return {1, redis.call('XADD', stream, '*', 'm', ARGV[4], 't', ARGV[3], 'c', ARGV[9] or '0'), stream}
end
return {1, redis.call('XADD', stream, '*', 'm', ARGV[4], 't', ARGV[3]), stream}
"""

#: A worker took requests: count them out of the queue. KEYS: queued, queued_tokens, tenant
#: tokens hash, worker tokens hash, worker queued hash. ARGV: number of requests, their
#: prompt tokens, the number k of tenant pairs, then k pairs (tenant stream, its prompt
#: tokens taken), then triples (worker routed to, its requests taken, their prompt tokens).
#: Never below zero (a Redis restart resets the counters). Allowed when Redis is full (it
#: frees memory): the entries are read already and must be counted.
TAKEN = """#!lua flags=allow-oom
local function take(hash, field, n)
  if redis.call('HINCRBY', hash, field, -n) <= 0 then redis.call('HDEL', hash, field) end
end
for i = 1, 2 do
  local v = redis.call('DECRBY', KEYS[i], ARGV[i])
  if v < 0 then redis.call('SET', KEYS[i], 0) end
end
local tenant_end = 3 + 2 * tonumber(ARGV[3])
for i = 4, tenant_end, 2 do take(KEYS[3], ARGV[i], tonumber(ARGV[i + 1])) end
for i = tenant_end + 1, #ARGV, 3 do
  take(KEYS[5], ARGV[i], tonumber(ARGV[i + 1]))
  take(KEYS[4], ARGV[i], tonumber(ARGV[i + 2]))
end
return 1
"""

#: Final outcome: acknowledge and delete the entry, but only while this worker owns it
#: (a worker wrongly thought dead must not ack what another worker now runs).
#: An entry of a routed stream leaves its tenant's count of routed entries in flight.
#: KEYS: the entry's stream, tenant routed hash. ARGV: group, consumer, entry id, the
#: tenant stream of a routed stream ("": the stream is a tenant stream). Returns 1 if
#: acknowledged.
ACK_IF_OWNER = """
local function ack_if_owner(stream, routed_hash, group, consumer, entry_id, tenant)
  local ok, p = pcall(redis.call, 'XPENDING', stream, group, entry_id, entry_id, 1)
  if not ok or p[1] == nil or p[1][2] ~= consumer then return 0 end
  redis.call('XACK', stream, group, entry_id)
  if redis.call('XDEL', stream, entry_id) == 1 and tenant ~= '' then
    if redis.call('HINCRBY', routed_hash, tenant, -1) <= 0 then redis.call('HDEL', routed_hash, tenant) end
  end
  return 1
end
return ack_if_owner(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
"""

#: A Lua function the scripts below share: the id of the last entry a consumer group has
#: been handed in a stream (everything after it is unread), or nil without that group.
_GROUP_CURSOR = """
local function group_cursor(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil end
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then return info['last-delivered-id'] end
  end
  return nil
end
"""

#: Steal: read, for this worker, the entries of other workers' routed streams that have
#: waited there longer than a delay (their owner is too busy to take them). The delay grows
#: with the prompt tokens the owner holds cached (the entry's 'c'): a thief computes them
#: again, so such an entry is worth waiting for a little longer. Each stream is read in
#: order, up to its first entry still too young. Atomic, so an entry is read by one worker
#: only and never one younger than its delay. KEYS: the routed streams to steal from.
#: ARGV: group, consumer, most entries in all, delay in milliseconds, milliseconds more per
#: cached token. Returns an XREADGROUP reply: {stream, {{id, {field, value, ...}}, ...}}
#: per stream it read from.
STEAL = _GROUP_CURSOR + """
local now = redis.call('TIME')
local cutoff = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - tonumber(ARGV[4])
local per_cached = tonumber(ARGV[5] or '0')
local room = tonumber(ARGV[3])
local out = {}
for _, stream in ipairs(KEYS) do
  if room <= 0 then break end
  local last = group_cursor(stream, ARGV[1])
  if last ~= nil then
    local aged = 0
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', room)) do
      local ms = tonumber(string.match(entry[1], '^(%d+)'))
      local cached = 0
      for i = 1, #entry[2], 2 do
        if entry[2][i] == 'c' then cached = tonumber(entry[2][i + 1]) or 0 end
      end
      if ms + cached * per_cached > cutoff then break end
      aged = aged + 1
    end
    if aged > 0 then
      local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', aged, 'STREAMS', stream, '>')
      if read then
        for _, r in ipairs(read) do
          table.insert(out, r)
          room = room - #r[2]
        end
      end
    end
  end
end
return out
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
#: and tokens are the entries no worker has read yet, in every request stream; a tenant's
#: routed entries in flight are its entries in routed streams; a worker's queued tokens
#: are the unread ones of its routed streams. A tenant stream with nothing in flight leaves
#: the tenants set; a routed stream leaves it (and is deleted) once empty and its worker is
#: no longer live, so a live worker keeps waiting on its own.
#: KEYS: tenants set, queued, queued_tokens, tenant tokens hash, tenant routed hash, worker
#: tokens hash, workers, worker queued hash. ARGV: group, routed prefix (queue_protocol.ROUTED .. ':'), the
#: stream of callers without a tenant (queue_protocol.REQUESTS). Returns {queued, queued tokens}.
RECONCILE = _GROUP_CURSOR + """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local prefix = ARGV[2]
local queued, tokens = 0, 0
redis.call('DEL', KEYS[4], KEYS[5], KEYS[6], KEYS[8])
for _, stream in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local tenant_stream, worker = stream, nil
  if string.sub(stream, 1, #prefix) == prefix then
    local rest = string.sub(stream, #prefix + 1)
    local colon = string.find(rest, ':', 1, true)
    if colon then
      worker = string.sub(rest, 1, colon - 1)
      tenant_stream = ARGV[3] .. ':' .. string.sub(rest, colon + 1)
    else
      worker = rest
      tenant_stream = ARGV[3]
    end
  end
  local length = redis.call('XLEN', stream)
  if length == 0 then
    if worker == nil then
      redis.call('SREM', KEYS[1], stream)
    elseif tonumber(redis.call('ZSCORE', KEYS[7], worker) or '0') < t then
      redis.call('SREM', KEYS[1], stream)
      redis.call('DEL', stream)
    end
  else
    local last = group_cursor(stream, ARGV[1]) or '0-0'
    local stream_tokens, stream_queued = 0, 0
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last, '+')) do
      stream_queued = stream_queued + 1
      local fields = entry[2]
      for i = 1, #fields, 2 do
        if fields[i] == 't' then stream_tokens = stream_tokens + tonumber(fields[i + 1]) end
      end
    end
    if stream_tokens > 0 then redis.call('HINCRBY', KEYS[4], tenant_stream, stream_tokens) end
    if worker ~= nil then
      redis.call('HINCRBY', KEYS[5], tenant_stream, length)
      if stream_tokens > 0 then redis.call('HINCRBY', KEYS[6], worker, stream_tokens) end
      if stream_queued > 0 then redis.call('HINCRBY', KEYS[8], worker, stream_queued) end
    end
    queued = queued + stream_queued
    tokens = tokens + stream_tokens
  end
end
redis.call('SET', KEYS[2], queued)
redis.call('SET', KEYS[3], tokens)
return {queued, tokens}
"""
