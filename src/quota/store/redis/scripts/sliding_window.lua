-- tower-admission: weighted window counter (an approximation of a sliding
-- window). Mirrors src/quota/algorithm/sliding_window.rs decision for decision.
--
-- Key: ONE hash {s = current window start µs, e = its end µs, c = current
-- count, p = previous count, g = epoch, as in fixed_window.lua}. The estimate is p * (1 - e/W) + c; the Rust
-- reference compares p * (W - e) + c * W with u128 integers, here the same
-- comparisons are made on ceil(p * (W - e) / W), computed exactly by muldiv.
-- Expires at e + W when c > 0, at e when only p > 0.

local sliding_window = {}

function sliding_window.load(key, limit, window)
  local v = redis.call('HMGET', key, 's', 'e', 'c', 'p', 'g')
  return {
    key = key, limit = limit, window = window,
    start = tonumber(v[1]) or 0, stop = tonumber(v[2]) or 0,
    c = tonumber(v[3]) or 0, p = tonumber(v[4]) or 0, g = tonumber(v[5]) or 0,
    exists = v[1] ~= false, dirty = false,
  }
end

local function sw_clear(s)
  s.start, s.stop, s.c, s.p, s.g = 0, 0, 0, 0, 0
end

-- Rolls the windows forward, never backwards (SlidingWindow::roll).
local function sw_advance(s, now)
  now = max(now, s.start)
  if now < s.stop and s.stop - s.start == s.window then return end
  local start = idiv(now, s.window) * s.window
  s.g = window_epoch(s, now)
  if now >= s.stop then
    if now < s.stop + s.window then s.p = s.c else s.p = 0 end
    s.c = 0
  end
  s.start = start
  s.stop = start + s.window
  s.dirty = true
end

-- A decision's roll: a state equivalent to fresh under these numbers is read
-- as fresh first, as the Rust store reads it (read_fresh), epoch included.
-- Returns the acting time.
local function sw_roll(s, now)
  if sliding_window.fresh_at(s) <= now then sw_clear(s) end
  local acting = max(now, s.start)
  sw_advance(s, now)
  return acting
end

function sliding_window.fresh_at(s)
  if s.c > 0 then return s.stop + s.window end
  if s.p > 0 then return s.stop end
  return 0
end

-- min(floor(n * W / d), W) for 0 <= n, d <= limit.
local function sw_keep(n, w, d)
  if n >= d then return w end
  return (muldiv(n, w, d))
end

function sliding_window.check(s, now, cost)
  now = sw_roll(s, now)
  local elapsed = now - s.start
  local w = s.window
  -- The previous window's weight, in whole units, rounded up.
  local weight = muldiv_ceil(s.p, w - elapsed, w)
  local remaining = max(s.limit - s.c - weight, 0)
  local reset = sat_sub(sliding_window.fresh_at(s), now)
  if cost > s.limit then return 0, remaining, -1, reset end
  local room = s.limit - s.c - cost
  if room >= 0 and weight <= room then
    return 1, room - weight, -1, s.stop + w - now
  end
  local wait
  if room >= 0 then
    -- Wait for the previous window's weight to decay enough.
    local e = w - sw_keep(room, w, max(s.p, 1))
    wait = max(e - elapsed, 1)
  else
    -- Next window: the current count becomes the previous one.
    local e = w - sw_keep(s.limit - cost, w, max(s.c, 1))
    wait = (s.stop - now) + e
  end
  return 0, remaining, wait, reset
end

function sliding_window.record(s, now, cost)
  sw_roll(s, now)
  local take = min(cost, sat_sub(s.limit, s.c))
  s.c = s.c + take
  s.dirty = true
  return s.stop, s.g, take
end

-- A settle reads the state as fresh only when both its whole key
-- (`whole_fresh`, see driver.lua) and the state under the settle's own
-- numbers are: its freshness depends on the window, and the settle's
-- numbers may be older than those that decided the state since. It never
-- realigns a live window of another length (see settle_may_roll).
function sliding_window.settle(s, now, delta, mark, frac, amount, whole_fresh)
  local fresh = sliding_window.fresh_at(s) <= now
  if whole_fresh and fresh then sw_clear(s) end
  if settle_may_roll(s, fresh, now) then sw_advance(s, now) end
  return window_settle(s, delta, mark, frac, amount)
end

-- `expiry`: the quota key's expiry after this call (driver.lua). A state
-- that holds nothing is kept while another policy keeps the quota key live,
-- as the memory store keeps it in the key's slot: a settle, which reads it
-- as fresh only with the whole key, continues its epoch.
function sliding_window.save(s, now, settled, expiry)
  local fresh_at = sliding_window.fresh_at(s)
  if fresh_at == 0 and expiry > now then fresh_at = expiry end
  local ttl = ttl_ms(fresh_at, now)
  if ttl == nil then
    if s.exists then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  redis.call('HSET', s.key, 's', s.start, 'e', s.stop, 'c', s.c, 'p', s.p, 'g', s.g)
  if settled then extend_ttl(s.key, ttl) else redis.call('PEXPIRE', s.key, ttl) end
end
