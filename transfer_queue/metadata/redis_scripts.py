"""The Lua scripts of the `redis` metadata backend (`redis.py`): each changes a record, its group
and the ownership checks in one atomic call. The ownership rule itself is `rules.MAY_ACT_LUA`,
beside its Python twin `rules.may_act`; the key layout is in `redis.py`'s docstring."""

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
"""

# ARGV: prefix, capacity, n, producer, then per record: uid, gid, size, sealed, blob (msgpack SampleMeta),
# memory ids (comma-joined, '' for none)
PUT = PUBLISH + CHUNKED + """
local p, cap, n, producer = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if tonumber(redis.call('GET', p..'resident') or '0') + n > cap then return -1 end
local held = 'put: a handle of %s refers to memory that another live record (or field) already holds'
local groups, order, uids, ids, mem = {}, {}, {}, {}, {}
for i = 5, 4 + 6 * n, 6 do
  local uid, gid, size = ARGV[i], ARGV[i+1], ARGV[i+2]
  if uids[uid] or redis.call('EXISTS', p..'idx:'..uid) == 1 then return redis.error_reply('uid '..uid..' is already in the queue') end
  uids[uid] = true
  for id in string.gmatch(ARGV[i+5], '[^,]+') do
    if ids[id] then return redis.error_reply(string.format(held, uid)) end
    ids[id] = uid
    table.insert(mem, id)
    table.insert(mem, uid)
  end
  local g = groups[gid]
  if not g then
    local cur = redis.call('HMGET', p..'grp:'..gid, 'size', 'n', 'pr')
    if cur[1] and cur[1] ~= size then return redis.error_reply('group '..gid..' has group_size '..cur[1]) end
    -- its producer: this put's for a new group (none for a group stored without one)
    g = {n = tonumber(cur[2] or '0'), add = 0, sealed = 0, size = size, new = not cur[1],
         pr = cur[3] or (not cur[1] and producer) or false}
    groups[gid] = g
    table.insert(order, gid)
  end
  g.add = g.add + 1
  g.sealed = g.sealed + tonumber(ARGV[i+3])
  if g.n + g.add > tonumber(size) then return redis.error_reply('group '..gid..' already has '..size..' records') end
end
for j = 1, #mem, 2000 do  -- one HMGET per 1000 memory ids
  local chunk = {}
  for k = j, math.min(j + 1999, #mem), 2 do table.insert(chunk, mem[k]) end
  local owner = redis.call('HMGET', p..'mem', unpack(chunk))
  for k = 1, #chunk do
    if owner[k] then return redis.error_reply(string.format(held, ids[chunk[k]])) end
  end
end
for i = 5, 4 + 6 * n, 6 do
  local uid, gid = ARGV[i], ARGV[i+1]
  local g = groups[gid]
  redis.call('SET', p..'idx:'..uid, gid)
  local f = {p..'grp:'..gid, 'r:'..uid, ARGV[i+4], 's:'..uid, ARGV[i+3], 'v:'..uid, 0}
  if g.pr ~= producer then  -- a record of another producer says whose it is
    table.insert(f, 'p:'..uid)
    table.insert(f, producer)
    g.mixed = true
  end
  if ARGV[i+5] ~= '' then
    table.insert(f, 'm:'..uid)
    table.insert(f, ARGV[i+5])
  end
  redis.call('HSET', unpack(f))
end
chunked('HSET', p..'mem', mem)
for _, gid in ipairs(order) do
  local g, key = groups[gid], p..'grp:'..gid
  if g.new then
    redis.call('HSET', key, 'size', g.size, 'pr', producer, 'n', g.add, 'sealed', g.sealed)
  else
    redis.call('HINCRBY', key, 'n', g.add)
    redis.call('HINCRBY', key, 'sealed', g.sealed)
    if g.mixed then redis.call('HSET', key, 'pm', 1) end
  end
  publish(p, gid)
end
redis.call('INCRBY', p..'resident', n)
redis.call('HINCRBY', p..'stats', 'put', n)
return n
"""

# ARGV: prefix, uid, version read by the caller, new blob, seal, client, memory ids released (of the fields
# replaced), memory ids added, memory ids of the new record, consumer groups...
# -1: changed meanwhile (retry), -2: gone, -3: not the producer or a lease holder (counted)
UPDATE = PUBLISH + OWNER + """
local p, uid, client = ARGV[1], ARGV[2], ARGV[6]
local gid = redis.call('GET', p..'idx:'..uid)
if not gid then return -2 end
local g = p..'grp:'..gid
local info = redis.call('HMGET', g, 'v:'..uid, 'p:'..uid, 'pr', 'eid')
local v, producer = info[1], info[2] or info[3]
if v ~= ARGV[3] then return -1 end
local ok = may_act(client, producer, nil)
for j = 10, #ARGV do
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
redis.call('HSET', g, 'r:'..uid, ARGV[4], 'v:'..uid, tonumber(v) + 1, 'm:'..uid, ARGV[9])
if ARGV[5] == '1' and redis.call('HGET', g, 's:'..uid) == '0' then
  redis.call('HSET', g, 's:'..uid, '1')
  redis.call('HINCRBY', g, 'sealed', 1)
  publish(p, gid)
end
return 0
"""

BLOBS = """
local function blobs(key)
  local out, kv = {}, redis.call('HGETALL', key)
  for j = 1, #kv, 2 do
    if string.sub(kv[j], 1, 2) == 'r:' then table.insert(out, kv[j+1]) end
  end
  return out
end
"""

# ARGV: prefix, gids...; returns per group the blobs of its records
LOAD = BLOBS + """
local p, out = ARGV[1], {}
for i = 2, #ARGV do table.insert(out, blobs(p..'grp:'..ARGV[i])) end
return out
"""

# ARGV: prefix, consumer group, number of consumer groups, cause ('' = ack), client ('' = the controller's
# own rule, e.g. a stale drop: no ownership check), uids...
# returns {records finished, blobs of the records freed...}, or {-1, uid} when the client may not (counted)
FINISH = BLOBS + OWNER + CHUNKED + """
local p, cg, ncg, cause, client = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local out, seen, todo, freed = {0}, {}, {}, {}
for i = 6, #ARGV do
  local gid = redis.call('GET', p..'idx:'..ARGV[i])
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
          return {-1, ARGV[i]}
        end
      end
      if info[1] then table.insert(todo, {g, info}) end
    end
  end
end
for _, t in ipairs(todo) do  -- a group never delivered to this consumer group is not finished (XACK 0)
  local g, info = t[1], t[2]
  if redis.call('XACK', p..'stream', cg, info[1]) == 1 then
    local n = tonumber(info[2])
    out[1] = out[1] + n
    local key = cause == '' and ('acked:'..cg) or ('dropped:'..cg..':'..cause)
    redis.call('HINCRBY', p..'stats', key, n)
    if redis.call('HINCRBY', g, 'done', 1) < ncg then
      redis.call('HSET', g, 'd:'..cg, 1)
    else
      local kv = redis.call('HGETALL', g)
      for j = 1, #kv, 2 do
        local f = kv[j]
        local kind = string.sub(f, 1, 2)
        if kind == 'r:' then
          table.insert(out, kv[j+1])
          redis.call('DEL', p..'idx:'..string.sub(f, 3))
        elseif kind == 'm:' then
          for id in string.gmatch(kv[j+1], '[^,]+') do table.insert(freed, id) end
        end
      end
      redis.call('DEL', g)
      redis.call('XDEL', p..'stream', info[1])
      redis.call('DECRBY', p..'resident', n)
      redis.call('HINCRBY', p..'stats', 'published', -n)
    end
  end
end
chunked('HDEL', p..'mem', freed)
return out
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
