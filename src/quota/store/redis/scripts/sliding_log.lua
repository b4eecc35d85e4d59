-- tower-admission: exact sliding log. A request at t is admitted only if the
-- cost admitted in (t - W, t] plus its own stays at or below the limit.
-- Mirrors src/quota/algorithm/sliding_log.rs decision for decision.
--
-- Key: ONE sorted set. Each admission is a member "<t>:<i>:<cost>" scored by
-- its time t in µs, where i (zero-padded) numbers the admissions sharing the
-- time t, so identical timestamps stay distinct entries. The sum of the costs
-- is kept in the member "total", scored -(1 + total): below every time, so
-- trimming by score never touches it. Entries at or before t - W are trimmed.
-- The key expires W after its newest entry.

local sliding_log = {}
local SL_TOTAL = 'total'

local function sl_parse(member)
  local t, i, c = string.match(member, '^(%d+):(%d+):(%d+)$')
  return tonumber(t), tonumber(i), tonumber(c)
end

local function sl_member(t, i, c)
  return string.format('%d:%07d:%d', t, i, c)
end

-- The newest entry's member and time, or nil.
local function sl_newest(key)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[1] == nil or newest[1] == SL_TOTAL then return nil, nil end
  return newest[1], tonumber(newest[2])
end

function sliding_log.load(key, limit, window)
  local s = { key = key, limit = limit, window = window, total = 0, dirty = false }
  local _, last = sl_newest(key)
  s.last = last
  local total = redis.call('ZSCORE', key, SL_TOTAL)
  if total then s.total = -tonumber(total) - 1 end
  s.exists = last ~= nil or total ~= false
  return s
end

-- Drops entries at or before now - W, where now never moves behind the
-- newest entry; returns that time.
local function sl_trim(s, now)
  if s.last == nil then return now end
  local acting = max(now, s.last)
  local cutoff = acting - s.window
  if cutoff < 0 then return acting end
  local old = redis.call('ZRANGEBYSCORE', s.key, 0, cutoff)
  if #old > 0 then
    for _, m in ipairs(old) do
      local _, _, c = sl_parse(m)
      s.total = s.total - c
    end
    redis.call('ZREMRANGEBYSCORE', s.key, 0, cutoff)
    s.dirty = true
    if s.last <= cutoff then s.last = nil end
  end
  return acting
end

function sliding_log.check(s, now, cost)
  sl_trim(s, now)
  local remaining = sat_sub(s.limit, s.total)
  local reset = 0
  if s.last ~= nil then reset = sat_sub(s.last + s.window, now) end
  if cost > s.limit then return 0, remaining, -1, reset end
  if cost <= remaining then
    if cost > 0 then reset = s.window end
    return 1, remaining - cost, -1, reset
  end
  -- Wait until enough of the oldest entries have left the window.
  local to_free = cost - remaining
  local wait = 0
  local offset = 0
  while true do
    local batch = redis.call('ZRANGEBYSCORE', s.key, 0, '+inf', 'LIMIT', offset, 128)
    if #batch == 0 then break end
    for _, m in ipairs(batch) do
      local t, _, c = sl_parse(m)
      wait = sat_sub(t + s.window, now)
      if c >= to_free then return 0, remaining, wait, reset end
      to_free = to_free - c
    end
    offset = offset + #batch
  end
  return 0, remaining, wait, reset
end

function sliding_log.record(s, now, cost)
  local acting = sl_trim(s, now)
  cost = min(cost, s.limit - s.total)
  if cost > 0 then
    local i = redis.call('ZCOUNT', s.key, acting, acting)
    redis.call('ZADD', s.key, acting, sl_member(acting, i, cost))
    s.total = s.total + cost
    s.last = acting
    s.dirty = true
  end
  return 0, 0, cost
end

function sliding_log.settle(s, now, delta, mark, frac, amount)
  sliding_log.adjust(s, now, delta)
  return mark, frac, amount
end

function sliding_log.adjust(s, now, delta)
  if delta >= 0 then
    sliding_log.record(s, now, delta)
    return
  end
  sl_trim(s, now)
  -- Refunds come off the newest admissions, the ones being settled.
  local refund = -delta
  while refund > 0 do
    local m = sl_newest(s.key)
    if m == nil then break end
    local t, i, c = sl_parse(m)
    local take = min(refund, c)
    redis.call('ZREM', s.key, m)
    if c > take then
      redis.call('ZADD', s.key, t, sl_member(t, i, c - take))
    end
    s.total = s.total - take
    refund = refund - take
    s.dirty = true
  end
  local _, last = sl_newest(s.key)
  s.last = last
end

function sliding_log.fresh_at(s)
  if s.last == nil then return 0 end
  return s.last + s.window
end

function sliding_log.save(s, now)
  local ttl = ttl_ms(sliding_log.fresh_at(s), now)
  if ttl == nil or s.total <= 0 then
    -- record and trim write at once, so a dirty state may exist too.
    if s.exists or s.dirty then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  redis.call('ZADD', s.key, -1 - s.total, SL_TOTAL)
  redis.call('PEXPIRE', s.key, ttl)
end
