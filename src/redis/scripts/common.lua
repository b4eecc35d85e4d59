-- tower-admission: helpers shared by every algorithm script.
--
-- Redis Lua numbers are doubles. Every value the scripts handle is an integer
-- below 2^53 (timestamps in microseconds are about 1.8e15), so plain
-- arithmetic is exact. Division is done by `idiv`, which corrects the rounding
-- of `a / b`, and products that may exceed 2^53 go through `muldiv`.

local function max(a, b)
  if a > b then return a end
  return b
end

local function min(a, b)
  if a < b then return a end
  return b
end

-- max(a - b, 0): Rust's saturating_sub on u64.
local function sat_sub(a, b)
  if a > b then return a - b end
  return 0
end

-- floor(a / b) for integers 0 <= a < 2^53 and b >= 1.
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q = q - 1
  elseif r >= b then
    q = q + 1
  end
  return q
end

local TWO52 = 4503599627370496
local B24 = 16777216

-- floor(a * b / d) and the remainder, exactly, for integers
-- 0 <= a, b <= 2^45 and 1 <= d <= 2^45. The product may reach 2^90: it is
-- built in base-2^24 limbs and divided one byte at a time, so every
-- intermediate value stays below 2^53.
local function muldiv(a, b, d)
  local p = a * b
  if p < TWO52 then
    local q = idiv(p, d)
    return q, p - q * d
  end
  local a0 = a % B24
  local a1 = (a - a0) / B24
  local b0 = b % B24
  local b1 = (b - b0) / B24
  local l0 = a0 * b0
  local l1 = a0 * b1 + a1 * b0
  local l2 = a1 * b1
  local d0 = l0 % B24
  l1 = l1 + (l0 - d0) / B24
  local d1 = l1 % B24
  l2 = l2 + (l1 - d1) / B24
  local d2 = l2 % B24
  local d3 = (l2 - d2) / B24
  local q, r = 0, 0
  local limbs = { d3, d2, d1, d0 }
  for i = 1, 4 do
    local limb = limbs[i]
    local lo = limb % 256
    local mid = ((limb - lo) / 256) % 256
    local hi = (limb - lo - mid * 256) / 65536
    local bytes = { hi, mid, lo }
    for j = 1, 3 do
      r = r * 256 + bytes[j]
      local digit = idiv(r, d)
      r = r - digit * d
      q = q * 256 + digit
    end
  end
  return q, r
end

-- ceil(a * b / d), same bounds as muldiv.
local function muldiv_ceil(a, b, d)
  local q, r = muldiv(a, b, d)
  if r > 0 then return q + 1 end
  return q
end

-- Whole milliseconds from `now` to `fresh_at` (both µs), rounded up so a key
-- never expires before its state is equivalent to fresh (plus the clock's
-- EXPIRY_PAD_MS, zero in production). nil when the state is already fresh:
-- the caller deletes the key instead.
local function ttl_ms(fresh_at, now)
  if fresh_at <= now then return nil end
  return idiv(fresh_at - now + 999, 1000) + EXPIRY_PAD_MS
end

-- The epoch of a window state moving to a new window at now: next_epoch in
-- src/quota/algorithm/mod.rs.
local function window_epoch(s, now)
  if s.stop == 0 then return now end
  if s.stop - s.start ~= s.window then return s.g + 1 end
  return s.g
end

-- Whether a settle at now may roll the counted window [s.start, s.stop) to
-- its own length s.window: not while that window is live, counts something
-- (fresh is false) and is of another length (settle_may_roll in
-- src/quota/algorithm/mod.rs).
local function settle_may_roll(s, fresh, now)
  return fresh or max(now, s.start) >= s.stop or s.stop - s.start == s.window
end

-- Moves the expiry of a key that is kept after a settle out to ttl ms,
-- never in: a settle may come under numbers older than the state's, and
-- never shortens its life. A key without an expiry (just created) gets it.
local function extend_ttl(key, ttl)
  local left = redis.call('PTTL', key)
  if left < 0 or left < ttl then redis.call('PEXPIRE', key, ttl) end
end

-- Settles a charge on a window's count s.c (window end s.stop, epoch s.g): the one
-- settlement rule of both window scripts, as settle_window in
-- src/quota/algorithm/mod.rs. Returns the hold after it.
local function window_settle(s, delta, mark, frac, amount)
  if delta >= 0 then
    s.c = s.c + min(delta, sat_sub(s.limit, s.c))
    s.dirty = true
    return mark, frac, amount
  end
  if mark ~= s.stop or frac ~= s.g then return mark, frac, amount end
  local refund = min(min(-delta, amount), s.c)
  s.c = s.c - refund
  s.dirty = true
  return mark, frac, amount - refund
end
