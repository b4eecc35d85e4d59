-- tower-admission: fixed window, clock-aligned windows [kW, (k+1)W).
-- Mirrors src/quota/algorithm/fixed_window.rs decision for decision.
--
-- Key: a hash {k = window index, c = cost admitted in window k}.
-- Expires when c == 0 or at (k + 1) * W, the moment the state is fresh.

local fixed_window = {}

function fixed_window.load(key, limit, window)
  local v = redis.call('HMGET', key, 'k', 'c')
  return {
    key = key, limit = limit, window = window,
    k = tonumber(v[1]) or 0, c = tonumber(v[2]) or 0,
    exists = v[1] ~= false, dirty = false,
  }
end

-- Moves to the window of `now`, never backwards; returns µs until it ends.
local function fw_roll(s, now)
  local k = max(idiv(now, s.window), s.k)
  if k ~= s.k then
    s.k = k
    s.c = 0
    s.dirty = true
  end
  return sat_sub((k + 1) * s.window, now)
end

-- Returns admitted (1/0), remaining, retry_after (µs, -1 for none), reset (µs).
function fixed_window.check(s, now, cost)
  local reset = fw_roll(s, now)
  local remaining = sat_sub(s.limit, s.c)
  if cost > s.limit then return 0, remaining, -1, reset end
  if cost <= remaining then return 1, remaining - cost, -1, reset end
  return 0, remaining, reset, reset
end

function fixed_window.record(s, now, cost)
  fw_roll(s, now)
  s.c = min(s.c + cost, s.limit)
  s.dirty = true
end

function fixed_window.adjust(s, now, delta)
  fw_roll(s, now)
  s.c = min(max(s.c + delta, 0), s.limit)
  s.dirty = true
end

function fixed_window.fresh_at(s)
  if s.c == 0 then return 0 end
  return (s.k + 1) * s.window
end

function fixed_window.save(s, now)
  local ttl = ttl_ms(fixed_window.fresh_at(s), now)
  if ttl == nil then
    if s.exists then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  redis.call('HSET', s.key, 'k', s.k, 'c', s.c)
  redis.call('PEXPIRE', s.key, ttl)
end
