"""The Lua scripts of the `redis` metadata backend (`redis.py`): each changes a record, its group
and the ownership checks in one atomic call. The ownership rule itself is `rules.MAY_ACT_LUA`,
beside its Python twin `rules.may_act`; the key layout is in `redis.py`'s docstring.

Cost is what bounds the queue's rate (`asyncrl bench queue`), so each script works per call and per
group, not per record, where Redis lets it: one HMGET/HSET of the `idx` hash for all uids of a call,
one HSET per group, one XDEL and one counter update per call. Per-record arguments travel packed in
one msgpack string (unpacked once by `cmsgpack`) beside the record blobs, which Lua never decodes;
records come back in one msgpack stream (one reply element, decoded in C), each as its uid, its tag
(`t:<uid>`, the MAC of `record_auth.py`; '' where none is) and its blob, each packed by Lua, so a
rewritten blob cannot shift the framing of the records after it."""

from transfer_queue.rules import MAY_ACT_LUA

# The owner helpers of every script that checks ownership (the rule itself: `rules.MAY_ACT_LUA`).
OWNER = MAY_ACT_LUA + """
local function holder(p, cg, eid)
  if not eid then return nil end
  local pe = redis.call('XPENDING', p..'stream', cg, eid, eid, 1)
  if pe[1] then return pe[1][2] end
  return nil
end
local function refuse(p)
  redis.call('HINCRBY', p..'stats', 'not_owner', 1)
end
"""

PUBLISH = """
local function publish(p, gid)
  local g = p..'grp:'..gid
  local v = redis.call('HMGET', g, 'size', 'n', 'sealed', 'eid')
  if not v[4] and v[1] == v[2] and v[2] == v[3] then
    redis.call('HSET', g, 'eid', redis.call('XADD', p..'stream', '*', 'gid', gid))
    redis.call('HINCRBY', p..'stats', 'published', tonumber(v[1]))
  end
end
"""

CHUNKED = """
local function chunked(cmd, key, args)  -- one call per 2000 arguments (Lua's stack is bounded)
  for i = 1, #args, 2000 do redis.call(cmd, key, unpack(args, i, math.min(i + 1999, #args))) end
end
local function hmget(key, fields)  -- HMGET in calls of 1000 fields; one value per field (false: missing)
  local out = {}
  for i = 1, #fields, 1000 do
    local r = redis.call('HMGET', key, unpack(fields, i, math.min(i + 999, #fields)))
    for j = 1, #r do out[#out + 1] = r[j] end
  end
  return out
end
"""

# ARGV: prefix, capacity, n, producer, head (msgpack array: per record uid, gid, size, sealed (0/1), memory ids
# comma-joined ('' for none)), then the n blobs (msgpack SampleMeta) in the same order, then their n tags ('': none)
PUT = CHUNKED + """
local p, cap, n, producer = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if tonumber(redis.call('GET', p..'resident') or '0') + n > cap then return -1 end
local head = cmsgpack.unpack(ARGV[5])
if #head ~= 5 * n or #ARGV ~= 5 + 2 * n then return redis.error_reply('put: malformed call') end
local held = 'put: a handle of %s refers to memory that another live record (or field) already holds'
local uids = {}
for r = 1, n do uids[r] = head[5 * r - 4] end
local known = hmget(p..'idx', uids)
local groups, order, seen, ids, mem, memids, idx = {}, {}, {}, {}, {}, {}, {}
for r = 1, n do
  local k = 5 * r - 5
  local uid, gid, size, sealed, m = head[k+1], head[k+2], head[k+3], head[k+4], head[k+5]
  if seen[uid] or known[r] then return redis.error_reply('uid '..uid..' is already in the queue') end
  seen[uid] = true
  for id in string.gmatch(m, '[^,]+') do
    if ids[id] then return redis.error_reply(string.format(held, uid)) end
    ids[id] = uid
    memids[#memids + 1] = id
    mem[#mem + 1] = id
    mem[#mem + 1] = uid
  end
  local g = groups[gid]
  if not g then
    local cur = redis.call('HMGET', p..'grp:'..gid, 'size', 'n', 'pr', 'sealed', 'eid')
    if cur[1] and tonumber(cur[1]) ~= size then return redis.error_reply('group '..gid..' has group_size '..cur[1]) end
    -- its producer: this put's for a new group (none for a group stored without one)
    g = {n = tonumber(cur[2] or '0'), sealed = tonumber(cur[4] or '0'), size = size, new = not cur[1],
         pr = cur[3] or (not cur[1] and producer) or false, eid = cur[5], f = {}}
    groups[gid] = g
    order[#order + 1] = gid
  end
  g.n = g.n + 1
  g.sealed = g.sealed + sealed
  if g.n > size then return redis.error_reply('group '..gid..' already has '..size..' records') end
  local f = g.f
  f[#f+1] = 'r:'..uid; f[#f+1] = ARGV[5 + r]; f[#f+1] = 's:'..uid; f[#f+1] = sealed; f[#f+1] = 'v:'..uid; f[#f+1] = 0
  if g.pr ~= producer then  -- a record of another producer says whose it is
    f[#f+1] = 'p:'..uid; f[#f+1] = producer
    g.mixed = true
  end
  if m ~= '' then f[#f+1] = 'm:'..uid; f[#f+1] = m end
  if ARGV[5 + n + r] ~= '' then f[#f+1] = 't:'..uid; f[#f+1] = ARGV[5 + n + r] end
  idx[#idx + 1] = uid
  idx[#idx + 1] = gid
end
local owner = hmget(p..'mem', memids)
for k = 1, #memids do
  if owner[k] then return redis.error_reply(string.format(held, ids[memids[k]])) end
end
chunked('HSET', p..'idx', idx)
chunked('HSET', p..'mem', mem)
local published = 0
for _, gid in ipairs(order) do  -- one HSET per group: its records and its counts
  local g = groups[gid]
  local f = g.f
  f[#f+1] = 'n'; f[#f+1] = g.n; f[#f+1] = 'sealed'; f[#f+1] = g.sealed
  if g.new then f[#f+1] = 'size'; f[#f+1] = g.size; f[#f+1] = 'pr'; f[#f+1] = producer end
  if g.mixed then f[#f+1] = 'pm'; f[#f+1] = 1 end
  if not g.eid and g.n == g.size and g.sealed == g.size then  -- complete and sealed: published
    f[#f+1] = 'eid'; f[#f+1] = redis.call('XADD', p..'stream', '*', 'gid', gid)
    published = published + g.size
  end
  chunked('HSET', p..'grp:'..gid, f)
end
redis.call('INCRBY', p..'resident', n)
redis.call('HINCRBY', p..'stats', 'put', n)
if published > 0 then redis.call('HINCRBY', p..'stats', 'published', published) end
return n
"""

# ARGV: prefix, uid, version read by the caller, new blob, seal, client, memory ids released (of the fields
# replaced), memory ids added, memory ids of the new record, the new blob's tag ('': none), consumer groups...
# -1: changed meanwhile (retry), -2: gone, -3: not the producer or a lease holder (counted)
UPDATE = PUBLISH + OWNER + """
local p, uid, client = ARGV[1], ARGV[2], ARGV[6]
local gid = redis.call('HGET', p..'idx', uid)
if not gid then return -2 end
local g = p..'grp:'..gid
local info = redis.call('HMGET', g, 'v:'..uid, 'p:'..uid, 'pr', 'eid')
local v, producer = info[1], info[2] or info[3]
if v ~= ARGV[3] then return -1 end
local ok = may_act(client, producer, nil)
for j = 11, #ARGV do
  if ok then break end
  ok = may_act(client, producer, holder(p, ARGV[j], info[4]))
end
if not ok then refuse(p) return -3 end
local new = {}
for id in string.gmatch(ARGV[8], '[^,]+') do
  if new[id] or redis.call('HEXISTS', p..'mem', id) == 1 then
    return redis.error_reply('update: a handle of '..uid..' refers to memory that another live record (or field) already holds')
  end
  new[id] = true
end
for id in string.gmatch(ARGV[7], '[^,]+') do redis.call('HDEL', p..'mem', id) end
for id in string.gmatch(ARGV[8], '[^,]+') do redis.call('HSET', p..'mem', id, uid) end
if ARGV[10] ~= '' then
  redis.call('HSET', g, 'r:'..uid, ARGV[4], 'v:'..uid, tonumber(v) + 1, 'm:'..uid, ARGV[9], 't:'..uid, ARGV[10])
else
  redis.call('HSET', g, 'r:'..uid, ARGV[4], 'v:'..uid, tonumber(v) + 1, 'm:'..uid, ARGV[9])
end
if ARGV[5] == '1' and redis.call('HGET', g, 's:'..uid) == '0' then
  redis.call('HSET', g, 's:'..uid, '1')
  redis.call('HINCRBY', g, 'sealed', 1)
  publish(p, gid)
end
return 0
"""

RECORDS = """
local function records(key)  -- a group's records {uid, blob}, their tags by uid, and the group's stream entry
  local rec, tags, eid, kv = {}, {}, false, redis.call('HGETALL', key)
  for j = 1, #kv, 2 do
    local kind = string.sub(kv[j], 1, 2)
    if kind == 'r:' then rec[#rec + 1] = {string.sub(kv[j], 3), kv[j+1]}
    elseif kind == 't:' then tags[string.sub(kv[j], 3)] = kv[j+1]
    elseif kv[j] == 'eid' then eid = kv[j+1] end
  end
  return rec, tags, eid
end
"""

# ARGV: prefix, gids...; returns per group its number of records (`stats`: what is leased)
LOAD = """
local p, out = ARGV[1], {}
for i = 2, #ARGV do
  local n, kv = 0, redis.call('HKEYS', p..'grp:'..ARGV[i])
  for j = 1, #kv do if string.sub(kv[j], 1, 2) == 'r:' then n = n + 1 end end
  out[#out + 1] = n
end
return out
"""

# One `get` step. ARGV: prefix, consumer group, consumer, own (1: first take back its own pending entries),
# claim idle ms (-1: no XAUTOCLAIM), claim count, entries wanted, number of skip ids, skip ids (parked by
# the caller: not offered again from its own pending list)..., then pairs (stream id, group id) the caller
# read already (a blocking XREADGROUP). Takes entries in that order (own, claimed, given, new up to
# `wanted`); an entry deleted or freed meanwhile is acknowledged and skipped, and so is one that is not its
# group's stream entry (another client's XADD: a replay of a group or a group never put), its records
# counted `forged`.
# Returns {records redelivered (own + claimed, counted), one msgpack stream: per entry its id, its group id,
# its number of records k, then per record its uid, tag and blob; records refused as not their entry's}.
READ = RECORDS + """
local p, cg, me = ARGV[1], ARGV[2], ARGV[3]
local stream, got, skip = p..'stream', {}, {}
local nskip = tonumber(ARGV[8])
for i = 9, 8 + nskip do skip[ARGV[i]] = true end
local function add(e, again)
  if not e then return end  -- an entry deleted while pending (XAUTOCLAIM of redis < 7 answers nil)
  if not e[2] then redis.call('XACK', stream, cg, e[1]) return end  -- deleted, left in a pending list
  got[#got + 1] = {e[1], e[2][2], again}
end
local function entries(r)  -- the entries of an XREADGROUP answer on one stream
  if r and r[1] then return r[1][2] end
  return {}
end
if ARGV[4] == '1' then
  local es = entries(redis.call('XREADGROUP', 'GROUP', cg, me, 'STREAMS', stream, '0'))
  for j = 1, #es do if not skip[es[j][1]] then add(es[j], true) end end
end
if tonumber(ARGV[5]) >= 0 then
  local es = redis.call('XAUTOCLAIM', stream, cg, me, ARGV[5], '0-0', 'COUNT', ARGV[6])[2]
  for j = 1, #es do add(es[j], true) end
end
for i = 9 + nskip, #ARGV, 2 do got[#got + 1] = {ARGV[i], ARGV[i+1], false} end
local want = tonumber(ARGV[7]) - #got
if want > 0 then
  local es = entries(redis.call('XREADGROUP', 'GROUP', cg, me, 'COUNT', want, 'STREAMS', stream, '>'))
  for j = 1, #es do add(es[j], false) end
end
local out, nred, nforged = {}, 0, 0
for _, e in ipairs(got) do
  local b, tags, eid = records(p..'grp:'..e[2])
  if #b == 0 or eid ~= e[1] then  -- freed meanwhile (a late ack elsewhere), or not the group's entry
    redis.call('XACK', stream, cg, e[1])
    if #b > 0 then nforged = nforged + #b end
  else
    out[#out + 1] = cmsgpack.pack(e[1], e[2], #b)
    for j = 1, #b do out[#out + 1] = cmsgpack.pack(b[j][1], tags[b[j][1]] or '', b[j][2]) end
    if e[3] then nred = nred + #b end
  end
end
if nred > 0 then redis.call('HINCRBY', p..'stats', 'redelivered:'..cg, nred) end
if nforged > 0 then redis.call('HINCRBY', p..'stats', 'forged', nforged) end
return {nred, table.concat(out), nforged}
"""

# ARGV: prefix, consumer group, number of consumer groups, cause ('' = ack), client ('' = the controller's
# own rule, e.g. a stale drop: no ownership check), uids (msgpack array), records only ('1'/'0'), and for
# cause 'forged' (groups with a record refused by `record_auth`, finished by the entry read, since none of
# their uids is trusted): (stream id, group id) pairs (msgpack array), records refused (counted `forged`).
# The records a group counts (`n`, what `put` counted) are counted under the cause.
# returns {records finished, per freed record that held memory its group id, uid, tag and blob (one msgpack
# stream)}, or {-1, uid} when the client may not (counted)
FINISH = OWNER + CHUNKED + """
local p, cg, ncg, cause, client = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local uids = cmsgpack.unpack(ARGV[6])
local only = cause ~= '' and ARGV[7] == '1'  -- a drop of the named records alone: the rest of their groups is acked
local gids = hmget(p..'idx', uids)
local seen, todo, named = {}, {}, {}
for i = 1, #uids do
  local gid = gids[i]
  if gid then named[gid] = (named[gid] or 0) + 1 end
  if gid and not seen[gid] then
    seen[gid] = true
    local g = p..'grp:'..gid
    local info = redis.call('HMGET', g, 'eid', 'n', 'd:'..cg, 'pr', 'pm')
    if not info[3] then  -- not finished for this consumer group yet (else: idempotent, nobody's business)
      if client ~= '' then
        local producer = info[4]
        if info[5] then producer = nil end  -- records of several producers: none of them owns the group
        if not may_act(client, producer, nil) and not may_act(client, producer, holder(p, cg, info[1])) then
          refuse(p)
          return {-1, uids[i]}
        end
      end
      if info[1] then todo[#todo + 1] = {g, info, gid} end
    end
  end
end
local forged = cause == 'forged' and cmsgpack.unpack(ARGV[8]) or {}
for i = 1, #forged, 2 do
  local g = p..'grp:'..forged[i + 1]
  local info = redis.call('HMGET', g, 'eid', 'n', 'd:'..cg, 'pr', 'pm')
  info[1] = forged[i]
  if info[3] then redis.call('XACK', p..'stream', cg, forged[i]) else todo[#todo + 1] = {g, info, forged[i + 1]} end
end
if #forged > 0 then redis.call('HINCRBY', p..'stats', 'forged', tonumber(ARGV[9])) end
local n, rest, removed, out, idx, freed, eids = 0, 0, 0, {}, {}, {}, {}
for _, t in ipairs(todo) do  -- a group never delivered to this consumer group is not finished (XACK 0)
  local g, info = t[1], t[2]
  if redis.call('XACK', p..'stream', cg, info[1]) == 1 then
    local size = tonumber(info[2]) or 0  -- (a group another client wrote may have no count)
    if only then
      local k = math.min(named[t[3]], size)
      n, rest = n + k, rest + size - k
    else
      n = n + size
    end
    if redis.call('HINCRBY', g, 'done', 1) < ncg then
      redis.call('HSET', g, 'd:'..cg, 1)
    else  -- finished for every consumer group: the group leaves
      local kv, rec, tags, holds = redis.call('HGETALL', g), {}, {}, {}
      for j = 1, #kv, 2 do
        local f = kv[j]
        local kind = string.sub(f, 1, 2)
        if kind == 'r:' then
          rec[string.sub(f, 3)] = kv[j+1]
          idx[#idx + 1] = string.sub(f, 3)
        elseif kind == 't:' then
          tags[string.sub(f, 3)] = kv[j+1]
        elseif kind == 'm:' and kv[j+1] ~= '' then
          holds[#holds + 1] = string.sub(f, 3)
          for id in string.gmatch(kv[j+1], '[^,]+') do freed[#freed + 1] = id end
        end
      end
      for _, uid in ipairs(holds) do
        if rec[uid] then out[#out + 1] = cmsgpack.pack(t[3], uid, tags[uid] or '', rec[uid]) end
      end
      redis.call('DEL', g)
      eids[#eids + 1] = info[1]
      removed = removed + size
    end
  end
end
if n > 0 then
  redis.call('HINCRBY', p..'stats', cause == '' and ('acked:'..cg) or ('dropped:'..cg..':'..cause), n)
end
if rest > 0 then
  redis.call('HINCRBY', p..'stats', 'acked:'..cg, rest)
end
if #eids > 0 then chunked('XDEL', p..'stream', eids) end
if removed > 0 then
  redis.call('DECRBY', p..'resident', removed)
  redis.call('HINCRBY', p..'stats', 'published', -removed)
end
chunked('HDEL', p..'idx', idx)
chunked('HDEL', p..'mem', freed)
return {n, table.concat(out)}
"""

# ARGV: prefix, consumer group, client, idle ms to set, entry ids...
# returns entries given back, or -1 when the client is neither the producer nor the holder (counted)
NACK = OWNER + """
local p, cg, client = ARGV[1], ARGV[2], ARGV[3]
local todo = {}
for i = 5, #ARGV do
  local eid = ARGV[i]
  local h = holder(p, cg, eid)
  if h then
    if not may_act(client, nil, h) then
      local e, producer = redis.call('XRANGE', p..'stream', eid, eid), nil
      if e[1] then
        local pr = redis.call('HMGET', p..'grp:'..e[1][2][2], 'pr', 'pm')
        if not pr[2] then producer = pr[1] end
      end
      if not may_act(client, producer, h) then refuse(p) return -1 end
    end
    table.insert(todo, {eid, h})
  end
end
for _, t in ipairs(todo) do  -- stays with its holder (a late ack still passes), claimable by anyone at once
  redis.call('XCLAIM', p..'stream', cg, t[2], 0, t[1], 'IDLE', ARGV[4], 'JUSTID')
end
return #todo
"""
# ARGV: prefix, consumer group, client, the lease's consumer id, number of lease entries, lease entry ids...,
# entry ids parked by this client...; returns lease entries renewed, or -1 when the lease is alive and
# held by someone else (counted). Only entries still pending under the client are touched: a lease
# taken over by another consumer is gone, never taken back.
RENEW = OWNER + """
local p, cg, client, me, nl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local alive, mine = 0, {}
for i = 6, 5 + nl do
  if holder(p, cg, ARGV[i]) == me then
    alive = alive + 1
    table.insert(mine, ARGV[i])
  end
end
if alive > 0 and client ~= me then refuse(p) return -1 end
for i = 6 + nl, #ARGV do
  if holder(p, cg, ARGV[i]) == client then table.insert(mine, ARGV[i]) end
end
for i = 1, #mine, 256 do
  local args = {p..'stream', cg, client, 0}
  for j = i, math.min(i + 255, #mine) do table.insert(args, mine[j]) end
  table.insert(args, 'JUSTID')
  redis.call('XCLAIM', unpack(args))
end
return alive
"""
