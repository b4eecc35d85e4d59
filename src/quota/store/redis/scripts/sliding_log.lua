-- tower-admission: exact sliding log. A request at t is admitted only if the
-- cost admitted in (t - W, t] plus its own stays at or below the limit.
-- Mirrors src/quota/algorithm/sliding_log.rs decision for decision.
--
-- Key: ONE sorted set holding only the entries, one per admission, scored by
-- its time t in µs. The member is "<t>:<seq>:<cost>:<cum>": seq is the
-- entry's sequence number (16 digits, so entries sharing a time sort by seq
-- and rank order is seq order), cost what the entry still holds, and cum the
-- running total of the costs through the entry, modulo 2^52 (only
-- differences are used; each is at most the cost held). Sequence numbers are
-- consecutive, so entry seq sits at rank seq - front_seq. The front entry
-- always holds cost. The state is read from the front and back members; the
-- key exists exactly while the log holds an entry and expires W after its
-- newest entry.
--
-- Work: a check that trims nothing reads two members; trimming is one
-- ZREMRANGEBYSCORE (O(log n + k)); a refusal's wait is a galloping then
-- binary search by rank on cum, O(log n) ZRANGE i i (O(log^2 n)); a refund
-- rewrites its entry and every later one, reaching back at most
-- SL_REFUND_REACH entries.
--
-- load(key, limit, window, _): the numbers of SlidingLog::script_args.

local sliding_log = {}
local SL_REFUND_REACH = 1024
local SL_MOD = 4503599627370496 -- 2^52

local function sl_parse(member)
  local t, seq, c, cum = string.match(member, '^(%d+):(%d+):(%d+):(%d+)$')
  if t == nil then
    error('tower-admission: sliding log entry of an unknown layout: ' .. member)
  end
  return tonumber(t), tonumber(seq), tonumber(c), tonumber(cum)
end

local function sl_member(t, seq, c, cum)
  return string.format('%d:%016d:%d:%d', t, seq, c, cum)
end

-- The cumulative cost of an entry's member.
local function sl_cum(member)
  local _, _, _, cum = sl_parse(member)
  return cum
end

-- The first rank in [lo, n) whose member satisfies pred (false, then true
-- along the log), and that member; n and nil if none. Gallops from lo, then
-- halves the last gap, exactly as `search` in sliding_log.rs.
local function sl_search(key, lo, n, pred)
  local low, high, step = lo, lo, 1
  local hit = nil
  while high < n do
    local m = redis.call('ZRANGE', key, high, high)[1]
    if pred(m) then
      hit = m
      break
    end
    low = high + 1
    high = high + step
    step = step * 2
  end
  if high >= n then
    high = n
    hit = nil
  end
  while low < high do
    local mid = math.floor((low + high) / 2)
    local m = redis.call('ZRANGE', key, mid, mid)[1]
    if pred(m) then
      high = mid
      hit = m
    else
      low = mid + 1
    end
  end
  return low, hit
end

local function sl_clear(s)
  s.front_seq = s.next_seq
  s.n, s.total, s.base, s.cum, s.oldest, s.newest = 0, 0, 0, 0, 0, 0
end

-- The member at rank 0 becomes the front, after the entries before it were
-- removed or it was refunded to nothing; entries holding no cost from there
-- on are removed too.
local function sl_refront(s)
  local m = redis.call('ZRANGE', s.key, 0, 0)[1]
  if m == nil then
    sl_clear(s)
    return
  end
  local t, seq, c, cum = sl_parse(m)
  local base = (cum - c) % SL_MOD
  if c == 0 then
    local j, hit = sl_search(s.key, 0, s.next_seq - seq, function(x)
      return sl_cum(x) ~= base
    end)
    if hit == nil then
      redis.call('DEL', s.key)
      sl_clear(s)
      return
    end
    redis.call('ZREMRANGEBYRANK', s.key, 0, j - 1)
    t, seq = sl_parse(hit)
  end
  s.front_seq = seq
  s.oldest = t
  s.base = base
  s.n = s.next_seq - seq
  s.total = (s.cum - base) % SL_MOD
end

function sliding_log.load(key, limit, window)
  local s = { key = key, limit = limit, window = window, next_seq = 0, dirty = false }
  sl_clear(s)
  local front = redis.call('ZRANGE', key, 0, 0)[1]
  if front == nil then return s end
  local back = redis.call('ZRANGE', key, -1, -1)[1]
  local ft, fseq, fc, fcum = sl_parse(front)
  local bt, bseq, _, bcum = sl_parse(back)
  s.front_seq = fseq
  s.next_seq = bseq + 1
  s.n = bseq + 1 - fseq
  s.oldest = ft
  s.newest = bt
  s.cum = bcum
  s.base = (fcum - fc) % SL_MOD
  s.total = (bcum - s.base) % SL_MOD
  return s
end

-- Drops entries at or before now - W; returns the time the log acts at
-- (never before its newest entry).
local function sl_trim(s, now)
  local acting = max(now, s.newest)
  if s.n == 0 or s.oldest + s.window > acting then return acting end
  redis.call('ZREMRANGEBYSCORE', s.key, '-inf', acting - s.window)
  sl_refront(s)
  return acting
end

-- Appends an entry of cost >= 1 at t; returns its sequence number.
local function sl_push(s, t, cost)
  if s.n == 0 then
    s.front_seq = t
    s.next_seq = s.front_seq
    s.oldest = t
    s.cum = 0
  end
  local seq = s.next_seq
  s.cum = (s.cum + cost) % SL_MOD
  redis.call('ZADD', s.key, t, sl_member(t, seq, cost, s.cum))
  s.next_seq = seq + 1
  s.n = s.n + 1
  s.total = s.total + cost
  s.newest = t
  s.dirty = true
  return seq
end

function sliding_log.check(s, now, cost)
  local acting = sl_trim(s, now)
  local remaining = sat_sub(s.limit, s.total)
  local reset = 0
  if s.n > 0 then reset = sat_sub(s.newest + s.window, acting) end
  if cost > s.limit then return 0, remaining, -1, reset end
  if cost <= remaining then
    if cost > 0 then reset = s.window end
    return 1, remaining - cost, -1, reset
  end
  -- Wait until the oldest entries holding to_free have left the window.
  local to_free = s.total - (s.limit - cost)
  local leaves = s.oldest
  if to_free > 1 then
    local base = s.base
    local _, hit = sl_search(s.key, 0, s.n, function(x)
      return (sl_cum(x) - base) % SL_MOD >= to_free
    end)
    if hit == nil then
      leaves = s.newest
    else
      leaves = min(sl_parse(hit), s.newest)
    end
  end
  return 0, remaining, max(sat_sub(leaves + s.window, acting), 1), reset
end

function sliding_log.record(s, now, cost)
  local acting = sl_trim(s, now)
  cost = min(cost, sat_sub(s.limit, s.total))
  if cost <= 0 then return 0, 0, 0 end
  -- The entry's number and time name it (see sliding_log.rs).
  return sl_push(s, acting, cost), acting, cost
end

-- The members from rank r on, with their cum lowered by take and the one at
-- rank r holding take less: ZADD the new members, then ZREM the old ones (in
-- that order, so the key and its expiry never vanish).
local function sl_refund_from(s, r, take)
  local old = redis.call('ZRANGE', s.key, r, -1)
  local chunk = 500
  for i = 1, #old, chunk do
    local adds, rems = {}, {}
    for j = i, min(i + chunk - 1, #old) do
      local t, seq, c, cum = sl_parse(old[j])
      if j == 1 then c = c - take end
      adds[#adds + 1] = t
      adds[#adds + 1] = sl_member(t, seq, c, (cum - take) % SL_MOD)
      rems[#rems + 1] = old[j]
    end
    redis.call('ZADD', s.key, unpack(adds))
    redis.call('ZREM', s.key, unpack(rems))
  end
end

-- Read, not trimmed (only decisions trim): since the charge, a redeploy may
-- have decided the log under a longer window, whose entries a trim to this
-- one would drop. The entries from rank `stay` on are those inside this
-- window: the others leave no room and give nothing back. The state is read
-- as fresh only when both its whole key (`whole_fresh`, see driver.lua) and
-- the log under this window are.
function sliding_log.settle(s, now, delta, mark, frac, amount, whole_fresh)
  if whole_fresh and s.n > 0 and sliding_log.fresh_at(s) <= now then
    redis.call('DEL', s.key)
    sl_clear(s)
  end
  local acting = max(now, s.newest)
  local window = s.window
  local stay = 0
  if s.total > 0 and s.oldest + window <= acting then
    stay = sl_search(s.key, 0, s.n, function(x)
      return sl_parse(x) + window > acting
    end)
  end
  if delta > 0 then
    local before = s.base
    if stay > 0 then before = sl_cum(redis.call('ZRANGE', s.key, stay - 1, stay - 1)[1]) end
    local held = (s.cum - before) % SL_MOD
    local add = min(delta, sat_sub(s.limit, held))
    if add > 0 then sl_push(s, acting, add) end
    return mark, frac, amount
  end
  local want = min(-delta, amount)
  if want <= 0 or mark < s.front_seq + stay or mark >= s.front_seq + s.n then
    return mark, frac, amount
  end
  local r = mark - s.front_seq
  -- Bounded work: a refund reaches back at most SL_REFUND_REACH entries
  -- (REFUND_REACH in sliding_log.rs); further back it gives nothing.
  if s.n - r > SL_REFUND_REACH then return mark, frac, amount end
  local t, _, held = sl_parse(redis.call('ZRANGE', s.key, r, r)[1])
  if t ~= frac then return mark, frac, amount end
  local take = min(want, held)
  if take <= 0 then return mark, frac, amount end
  sl_refund_from(s, r, take)
  s.cum = (s.cum - take) % SL_MOD
  s.total = s.total - take
  s.dirty = true
  if r == 0 and take == held then sl_refront(s) end
  return mark, frac, amount - take
end

function sliding_log.fresh_at(s)
  if s.n == 0 then return 0 end
  return s.newest + s.window
end

function sliding_log.save(s, now, settled)
  -- An empty log has no members left, so its key is already gone.
  if s.n == 0 then return end
  local ttl = ttl_ms(sliding_log.fresh_at(s), now)
  if settled then
    -- Left as it was (entries this window no longer holds), or moved out.
    if ttl ~= nil and s.dirty then extend_ttl(s.key, ttl) end
    return
  end
  if ttl == nil then
    redis.call('DEL', s.key)
    return
  end
  -- A decision that changed nothing still moves the expiry out when the
  -- window has grown since the last write (PTTL rounds down: a margin of
  -- 1 ms keeps an unchanged window from rewriting it).
  if s.dirty or redis.call('PTTL', s.key) + 1 < ttl then
    redis.call('PEXPIRE', s.key, ttl)
  end
end
