-- tower-admission: fixed window, clock-aligned windows [kW, (k+1)W).
-- Mirrors src/quota/algorithm/fixed_window.rs decision for decision.
--
-- Key: a hash {s = window start µs, e = window end µs, c = cost admitted,
-- g = epoch: how many times the stored window changed length, so that a
-- charge's hold (e, g) names its window}.
-- The state knows the window it was counted in, so a policy whose window
-- changed reads it correctly: the count carries into the new policy's
-- aligned window holding `now`. Expires when c == 0 or at e.

local fixed_window = {}

function fixed_window.load(key, limit, window)
  local v = redis.call('HMGET', key, 's', 'e', 'c', 'g')
  return {
    key = key, limit = limit, window = window,
    start = tonumber(v[1]) or 0, stop = tonumber(v[2]) or 0, c = tonumber(v[3]) or 0,
    g = tonumber(v[4]) or 0, exists = v[1] ~= false, dirty = false,
  }
end

-- A state equivalent to fresh read as fresh, as the Rust store reads it
-- (read_fresh), epoch included. A fixed window's freshness depends on no
-- numbers, so decisions and settles alike read it so.
local function fw_read_fresh(s, now)
  if fixed_window.fresh_at(s) <= now then s.start, s.stop, s.c, s.g = 0, 0, 0, 0 end
end

-- Moves to the window of `now`, never backwards (FixedWindow::roll).
local function fw_advance(s, now)
  now = max(now, s.start)
  if now >= s.stop then
    s.c = 0
  elseif s.stop - s.start == s.window then
    return
  end
  s.g = window_epoch(s, now)
  s.start = idiv(now, s.window) * s.window
  s.stop = s.start + s.window
  s.dirty = true
end

-- A decision's roll: the state read as fresh first; returns the acting time.
local function fw_roll(s, now)
  fw_read_fresh(s, now)
  local acting = max(now, s.start)
  fw_advance(s, now)
  return acting
end

-- Returns admitted (1/0), remaining, retry_after (µs, -1 for none), reset (µs).
function fixed_window.check(s, now, cost)
  now = fw_roll(s, now)
  local reset = s.stop - now
  local remaining = sat_sub(s.limit, s.c)
  if cost > s.limit then return 0, remaining, -1, reset end
  if cost <= remaining then return 1, remaining - cost, -1, reset end
  return 0, remaining, reset, reset
end

function fixed_window.record(s, now, cost)
  fw_roll(s, now)
  local take = min(cost, sat_sub(s.limit, s.c))
  s.c = s.c + take
  s.dirty = true
  return s.stop, s.g, take
end

-- A settle never realigns a live window of another length (see
-- settle_may_roll).
function fixed_window.settle(s, now, delta, mark, frac, amount)
  fw_read_fresh(s, now)
  if settle_may_roll(s, fixed_window.fresh_at(s) <= now, now) then fw_advance(s, now) end
  return window_settle(s, delta, mark, frac, amount)
end

function fixed_window.fresh_at(s)
  if s.c == 0 then return 0 end
  return s.stop
end

function fixed_window.save(s, now, settled)
  local ttl = ttl_ms(fixed_window.fresh_at(s), now)
  if ttl == nil then
    if s.exists then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  redis.call('HSET', s.key, 's', s.start, 'e', s.stop, 'c', s.c, 'g', s.g)
  if settled then extend_ttl(s.key, ttl) else redis.call('PEXPIRE', s.key, ttl) end
end
