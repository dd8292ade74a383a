-- shoal quota: one call of this script applies one whole batch. Redis runs a script without
-- interleaving anything else, so every item (and the batch) is atomic, whichever limiter
-- process on whichever machine sent it. The semantics are those of sqlite_backend.py.
--
-- Keys are built from the prefix ARGV[1] rather than passed in KEYS: they depend on the
-- batch's content. That suits a single node or Sentinel, not Cluster.
--
-- ARGV[2] is the operation:
--   reserve      ttl_ms hint_ms n {lease_id fingerprint m {key amount}*m}*n
--                -> {allowed, retry_after_ms, reserved_at_ms, error}*n
--   complete     n {lease_id m {key actual}*m}*n -> {ok, error}*n
--   put_limits   n {key kind capacity window_ms}*n -> "" or the key whose kind differs
--   usage        -> {key, kind, capacity, window_ms, used}* (expired holds dropped first)
--
-- Per limit key K: hash P:limit:K {kind, capacity, window_ms, used}; zset P:exp:K (hold id ->
-- expiry ms) and hash P:amt:K (hold id -> amount), a hold id being "<lease>|r" (reserved)
-- or "<lease>|o" (debt added by a Complete). Per lease: hash P:lease:ID {fp, ok, retry, at,
-- done, "r:"..key = amount} expiring with the lease.

local P = ARGV[1]
local op = ARGV[2]
local LIMITS = P .. ':limits'

local function lim_key(k) return P .. ':limit:' .. k end
local function exp_key(k) return P .. ':exp:' .. k end
local function amt_key(k) return P .. ':amt:' .. k end
local function lease_key(id) return P .. ':lease:' .. id end

-- The server's clock, never behind the latest time stored, so a clock moved back frees
-- nothing early.
local function now_ms()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local last = tonumber(redis.call('GET', P .. ':clock') or 0)
  if last > now then now = last end
  redis.call('SET', P .. ':clock', now)
  return now
end

local function purge(k, now)
  local ids = redis.call('ZRANGEBYSCORE', exp_key(k), '-inf', now)
  if #ids == 0 then return end
  local ak, freed = amt_key(k), 0
  for _, id in ipairs(ids) do
    freed = freed + tonumber(redis.call('HGET', ak, id) or 0)
    redis.call('HDEL', ak, id)
  end
  redis.call('ZREMRANGEBYSCORE', exp_key(k), '-inf', now)
  redis.call('HINCRBY', lim_key(k), 'used', -freed)
end

-- A limit with its expired holds dropped, or nil when the key is unknown.
local function limit(k, now)
  local v = redis.call('HMGET', lim_key(k), 'kind', 'capacity', 'window_ms')
  if not v[1] then return nil end
  purge(k, now)
  return {
    kind = v[1], cap = tonumber(v[2]), win = tonumber(v[3]),
    used = tonumber(redis.call('HGET', lim_key(k), 'used')),
  }
end

-- How long until enough holds expire for `amount` to fit (see SQLiteBackend._wait_ms).
local function wait_ms(k, lim, amount, now, hint)
  local need, freed, wait = lim.used + amount - lim.cap, 0, lim.win
  local ak, offset, found = amt_key(k), 0, false
  while not found do
    local page = redis.call('ZRANGE', exp_key(k), offset, offset + 255, 'WITHSCORES')
    if #page == 0 then break end
    for i = 1, #page, 2 do
      freed = freed + tonumber(redis.call('HGET', ak, page[i]))
      if freed >= need then
        wait = tonumber(page[i + 1]) - now
        found = true
        break
      end
    end
    offset = offset + 256
  end
  if lim.kind == 'concurrency' and wait > hint then wait = hint end
  if wait < 1 then wait = 1 end
  return wait
end

local function add_hold(k, lim, hid, amount, expires)
  redis.call('ZADD', exp_key(k), expires, hid)
  redis.call('HSET', amt_key(k), hid, amount)
  redis.call('HINCRBY', lim_key(k), 'used', amount)
end

-- Give back `amount` of the lease's reserved hold on `k`, if it has not expired.
local function refund(k, id, amount)
  local hid, ak = id .. '|r', amt_key(k)
  local held = redis.call('HGET', ak, hid)
  if not held then return end
  held = tonumber(held)
  if held > amount then
    redis.call('HSET', ak, hid, held - amount)
  else
    redis.call('HDEL', ak, hid)
    redis.call('ZREM', exp_key(k), hid)
    amount = held
  end
  redis.call('HINCRBY', lim_key(k), 'used', -amount)
end

local function reserve_one(id, fp, reqs, now, ttl, hint)
  local lk = lease_key(id)
  local prev = redis.call('HMGET', lk, 'fp', 'ok', 'retry', 'at')
  if prev[1] then
    if prev[1] ~= fp then return {0, 0, 0, 'lease_conflict'} end
    return {tonumber(prev[2]), tonumber(prev[3]), tonumber(prev[4]), ''}
  end
  local lims = {}
  for i, r in ipairs(reqs) do
    local lim = limit(r[1], now)
    if not lim then return {0, 0, 0, 'unknown_limit_key:' .. r[1]} end
    if r[2] > lim.cap then return {0, 0, 0, 'exceeds_capacity:' .. r[1]} end
    lims[i] = lim
  end
  local denied, retry = false, 0
  for i, r in ipairs(reqs) do
    if lims[i].used + r[2] > lims[i].cap then
      denied = true
      local w = wait_ms(r[1], lims[i], r[2], now, hint)
      if w > retry then retry = w end
    end
  end
  local expires = now + ttl
  if denied then
    redis.call('HSET', lk, 'fp', fp, 'ok', 0, 'retry', retry, 'at', 0, 'done', 0)
    redis.call('PEXPIREAT', lk, expires)
    return {0, retry, 0, ''}
  end
  for i, r in ipairs(reqs) do
    local hold_expires = now + lims[i].win
    add_hold(r[1], lims[i], id .. '|r', r[2], hold_expires)
    redis.call('HSET', lk, 'r:' .. r[1], r[2])
    if hold_expires > expires then expires = hold_expires end
  end
  redis.call('HSET', lk, 'fp', fp, 'ok', 1, 'retry', 0, 'at', now, 'done', 0)
  redis.call('PEXPIREAT', lk, expires)
  return {1, 0, now, ''}
end

local function complete_one(id, actuals, now)
  local lk = lease_key(id)
  local fields = redis.call('HGETALL', lk)
  if #fields == 0 then return {0, 'lease_not_found'} end
  local h, reserved, keys = {}, {}, {}
  for i = 1, #fields, 2 do
    local name = fields[i]
    if string.sub(name, 1, 2) == 'r:' then
      local k = string.sub(name, 3)
      reserved[k] = tonumber(fields[i + 1])
      keys[#keys + 1] = k
    else
      h[name] = fields[i + 1]
    end
  end
  if h.ok == '0' then return {0, 'lease_denied'} end
  if h.done == '1' then return {0, 'already_completed'} end
  local spent = {}
  for _, a in ipairs(actuals) do
    local lim = limit(a[1], now)
    if not lim then return {0, 'unknown_limit_key:' .. a[1]} end
    if lim.kind ~= 'rate' then return {0, 'invalid_request'} end
    spent[a[1]] = a[2]
    if not reserved[a[1]] then keys[#keys + 1] = a[1] end
  end
  for _, k in ipairs(keys) do
    local lim = limit(k, now)
    if lim then
      local amount = reserved[k] or 0
      local s = spent[k] or amount
      if lim.kind == 'concurrency' then
        refund(k, id, amount)
      elseif s < amount then
        refund(k, id, amount - s)
      elseif s > amount then  -- debt: charged from now, for one window
        add_hold(k, lim, id .. '|o', s - amount, now + lim.win)
      end
    end
  end
  redis.call('HSET', lk, 'done', 1)
  return {1, ''}
end

-- Reads `m` (key, number) pairs starting at ARGV[j].
local function pairs_at(j, m)
  local out = {}
  for r = 0, m - 1 do
    out[r + 1] = {ARGV[j + 2 * r], tonumber(ARGV[j + 2 * r + 1])}
  end
  return out
end

if op == 'reserve' then
  local now = now_ms()
  local ttl, hint, n = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local out, j = {}, 6
  for i = 1, n do
    local m = tonumber(ARGV[j + 2])
    out[i] = reserve_one(ARGV[j], ARGV[j + 1], pairs_at(j + 3, m), now, ttl, hint)
    j = j + 3 + 2 * m
  end
  return out
elseif op == 'complete' then
  local now = now_ms()
  local n = tonumber(ARGV[3])
  local out, j = {}, 4
  for i = 1, n do
    local m = tonumber(ARGV[j + 1])
    out[i] = complete_one(ARGV[j], pairs_at(j + 2, m), now)
    j = j + 2 + 2 * m
  end
  return out
elseif op == 'put_limits' then
  local n = tonumber(ARGV[3])
  for i = 0, n - 1 do
    local k, kind = ARGV[4 + 4 * i], ARGV[5 + 4 * i]
    local old = redis.call('HGET', lim_key(k), 'kind')
    if old and old ~= kind then return k end
  end
  for i = 0, n - 1 do
    local b = 4 + 4 * i
    local k = ARGV[b]
    redis.call('HSET', lim_key(k), 'kind', ARGV[b + 1], 'capacity', ARGV[b + 2],
      'window_ms', ARGV[b + 3])
    redis.call('HSETNX', lim_key(k), 'used', 0)
    redis.call('SADD', LIMITS, k)
  end
  return ''
elseif op == 'usage' then
  local now = now_ms()
  local out = {}
  for _, k in ipairs(redis.call('SMEMBERS', LIMITS)) do
    local lim = limit(k, now)
    if lim then out[#out + 1] = {k, lim.kind, lim.cap, lim.win, lim.used} end
  end
  return out
end
return redis.error_reply('unknown operation ' .. tostring(op))
