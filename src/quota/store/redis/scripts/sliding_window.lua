-- tower-admission: weighted window counter (an approximation of a sliding
-- window). Mirrors src/quota/algorithm/sliding_window.rs decision for decision.
--
-- Key: ONE hash {k = current window index, c = current count, p = previous
-- count}. The estimate is p * (1 - e/W) + c; the Rust reference compares
-- p * (W - e) + c * W with u128 integers, here the same comparisons are made
-- on ceil(p * (W - e) / W), computed exactly by muldiv.
-- Expires at (k + 2) * W when c > 0, at (k + 1) * W when only p > 0.

local sliding_window = {}

function sliding_window.load(key, limit, window)
  local v = redis.call('HMGET', key, 'k', 'c', 'p')
  return {
    key = key, limit = limit, window = window,
    k = tonumber(v[1]) or 0, c = tonumber(v[2]) or 0, p = tonumber(v[3]) or 0,
    exists = v[1] ~= false, dirty = false,
  }
end

-- Rolls the windows forward; returns µs elapsed in the current one.
local function sw_roll(s, now)
  local k = max(idiv(now, s.window), s.k)
  local d = k - s.k
  if d == 1 then
    s.p = s.c
    s.c = 0
  elseif d > 1 then
    s.p = 0
    s.c = 0
  end
  if d ~= 0 then
    s.k = k
    s.dirty = true
  end
  return sat_sub(now, k * s.window)
end

function sliding_window.fresh_at(s)
  if s.c > 0 then return (s.k + 2) * s.window end
  if s.p > 0 then return (s.k + 1) * s.window end
  return 0
end

-- min(floor(n * W / d), W) for 0 <= n, d <= limit.
local function sw_keep(n, w, d)
  if n >= d then return w end
  return (muldiv(n, w, d))
end

function sliding_window.check(s, now, cost)
  local elapsed = sw_roll(s, now)
  local w = s.window
  -- The previous window's weight, in whole units, rounded up.
  local weight = muldiv_ceil(s.p, w - elapsed, w)
  local remaining = max(s.limit - s.c - weight, 0)
  local reset = sat_sub(sliding_window.fresh_at(s), now)
  if cost > s.limit then return 0, remaining, -1, reset end
  local room = s.limit - s.c - cost
  if room >= 0 and weight <= room then
    return 1, room - weight, -1, (s.k + 2) * w - now
  end
  local wait
  if room >= 0 then
    -- Wait for the previous window's weight to decay enough.
    local e = w - sw_keep(room, w, max(s.p, 1))
    wait = max(e - elapsed, 1)
  else
    -- Next window: the current count becomes the previous one.
    local e = w - sw_keep(s.limit - cost, w, max(s.c, 1))
    wait = ((s.k + 1) * w - max(now, s.k * w)) + e
  end
  return 0, remaining, wait, reset
end

function sliding_window.record(s, now, cost)
  sw_roll(s, now)
  s.c = min(s.c + cost, s.limit)
  s.dirty = true
end

function sliding_window.adjust(s, now, delta)
  sw_roll(s, now)
  s.c = min(max(s.c + delta, 0), s.limit)
  s.dirty = true
end

function sliding_window.save(s, now)
  local ttl = ttl_ms(sliding_window.fresh_at(s), now)
  if ttl == nil then
    if s.exists then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  redis.call('HSET', s.key, 'k', s.k, 'c', s.c, 'p', s.p)
  redis.call('PEXPIRE', s.key, ttl)
end
