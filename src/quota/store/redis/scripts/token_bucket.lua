-- tower-admission: token bucket as GCRA, capacity B, one token every p/q µs
-- (the reduced fraction period / refill). Mirrors
-- src/quota/algorithm/token_bucket.rs decision for decision and state for
-- state; see that file for the rules (changed numbers, settlement).
--
-- load(key, B, p, q): the three numbers are TokenBucket::script_args().
--
-- Key: a string "tat:frac:den:off:last:born":
--   tat, frac  the theoretical arrival time, whole µs plus frac/den µs;
--   den        the denominator q it was written under, 0 for whole µs (q = 1);
--   off        the settlement offset, whole µs (holds' marks are tat + off);
--   last       the latest time it was written, µs;
--   born       the state's life: the time of its first write since fresh.
-- The older formats are read with a life of 0: one without `born`, and a
-- bare integer, read as the TAT in whole µs. The key expires when the state
-- is equivalent to fresh: at ceil(tat) + off.
--
-- Exact in doubles (TokenBucket::lua_exact): times below 2^52 µs, and with
-- q = 1 a time to refill from empty B*p of at most 2^50 µs; with q > 1,
-- B and p at most 2^45 and B*p/q below 2^45 µs. Every product of an amount
-- and the interval goes through muldiv; whole µs and fractions (in 1/q µs)
-- are added with a carry, so nothing leaves 2^53.

local token_bucket = {}

local TB_MAX_OFFSET = 2251799813685248 -- 2^51 µs, as MAX_OFFSET in Rust

-- (w1, f1) + (w2, f2): whole µs and fractions in 1/q µs.
local function tb_add(q, w1, f1, w2, f2)
  local f = f1 + f2
  if f >= q then return w1 + w2 + 1, f - q end
  return w1 + w2, f
end

-- (w1, f1) - (w2, f2), for (w1, f1) >= (w2, f2).
local function tb_sub(q, w1, f1, w2, f2)
  local f = f1 - f2
  if f < 0 then return w1 - w2 - 1, f + q end
  return w1 - w2, f
end

-- (w1, f1) <= (w2, f2)
local function tb_le(w1, f1, w2, f2)
  return w1 < w2 or (w1 == w2 and f1 <= f2)
end

-- n intervals, n * p / q µs, as (whole, frac); n <= B.
local function tb_span(s, n)
  if s.q == 1 then return n * s.p, 0 end
  return muldiv(n, s.p, s.q)
end

-- Whole intervals in the duration (w, f): floor((w * q + f) / p).
local function tb_tokens(s, w, f)
  if s.q == 1 then return idiv(w, s.p) end
  local t, r = muldiv(w, s.q, s.p)
  return t + idiv(r + f, s.p)
end

-- The duration (w, f) in whole µs, rounded up.
local function tb_ceil(w, f)
  if f > 0 then return w + 1 end
  return w
end

-- Tokens from (w, f) up to the horizon (hw, hf); 0 at or beyond it.
local function tb_room(s, hw, hf, w, f)
  if tb_le(hw, hf, w, f) then return 0 end
  return tb_tokens(s, tb_sub(s.q, hw, hf, w, f))
end

function token_bucket.load(key, capacity, p, q)
  local raw = redis.call('GET', key)
  local s = {
    key = key, B = capacity, p = p, q = q,
    tat = 0, frac = 0, den = 0, off = 0, last = 0, born = 0,
    exists = raw ~= false, dirty = false,
  }
  s.Ww, s.Wf = tb_span(s, capacity)
  s.unit = q
  if q == 1 then s.unit = 0 end
  if raw then
    local t, f, d, o, l, b = string.match(raw, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+)$')
    if not t then
      t, f, d, o, l = string.match(raw, '^(%d+):(%d+):(%d+):(%d+):(%d+)$')
    end
    if t then
      s.tat, s.frac, s.den = tonumber(t), tonumber(f), tonumber(d)
      s.off, s.last = tonumber(o), tonumber(l)
      s.born = tonumber(b) or 0
    else
      s.tat = tonumber(raw) or 0
    end
  end
  return s
end

-- A state equivalent to fresh read as a fresh state, whatever numbers wrote
-- it, keeping `last` (TokenBucketState::read_fresh); then its TAT in this
-- denominator (TokenBucket::in_unit): a fraction in another one rounded up
-- to the whole µs (offset + 1 µs). Only ever later.
local function tb_in_unit(s, now)
  if s.exists and token_bucket.fresh_at(s) <= now then
    s.tat, s.frac, s.den, s.off, s.born = 0, 0, 0, 0, 0
  end
  local whole = s.den == 0 and s.frac == 0
  if (s.den ~= s.unit and not whole) or s.frac >= s.q then
    if s.frac ~= 0 then
      s.tat = s.tat + 1
      s.frac = 0
    end
    s.off = s.off + 1
    s.den = s.unit
    s.dirty = true
  end
end

-- The state under these numbers (TokenBucket::prepare): tb_in_unit, and a
-- TAT beyond max(now, last) + B*p/q clamped to it (the cut added to the
-- offset). Decisions only: a settle never clamps.
local function tb_prepare(s, now)
  tb_in_unit(s, now)
  local q = s.q
  local ref = max(now, s.last)
  local cw, cf = tb_add(q, ref, 0, s.Ww, s.Wf)
  if not tb_le(s.tat, s.frac, cw, cf) then
    s.off = s.off + tb_ceil(tb_sub(q, s.tat, s.frac, cw, cf))
    s.tat, s.frac = cw, cf
    s.den = s.unit
    s.last = ref
    s.dirty = true
  end
end

-- Writes the TAT (nw, nf) set at now (TokenBucket::store): a write to a
-- fresh state begins a new life; idle time since the old TAT is given back
-- from the offset.
local function tb_store(s, now, nw, nf)
  if s.tat == 0 and s.frac == 0 and s.off == 0 then s.born = now end
  if s.tat < now then
    local idle = now - s.tat
    if s.frac > 0 then idle = idle - 1 end
    s.off = s.off - min(s.off, idle)
  end
  s.tat, s.frac, s.den = nw, nf, s.unit
  s.last = max(s.last, now)
  s.dirty = true
end

-- max(tat, now)
local function tb_start(s, now)
  if s.tat < now then return now, 0 end
  return s.tat, s.frac
end

function token_bucket.check(s, now, cost)
  tb_prepare(s, now)
  local q = s.q
  local hw, hf = tb_add(q, now, 0, s.Ww, s.Wf)
  local sw, sf = tb_start(s, now)
  if cost > s.B then
    return 0, tb_room(s, hw, hf, sw, sf), -1, tb_ceil(tb_sub(q, sw, sf, now, 0))
  end
  local cw, cf = tb_span(s, cost)
  local nw, nf = tb_add(q, sw, sf, cw, cf)
  if tb_le(nw, nf, hw, hf) then
    return 1, tb_room(s, hw, hf, nw, nf), -1, tb_ceil(tb_sub(q, nw, nf, now, 0))
  end
  return 0, tb_room(s, hw, hf, sw, sf), tb_ceil(tb_sub(q, nw, nf, hw, hf)),
    tb_ceil(tb_sub(q, sw, sf, now, 0))
end

function token_bucket.record(s, now, cost)
  tb_prepare(s, now)
  local q = s.q
  local hw, hf = tb_add(q, now, 0, s.Ww, s.Wf)
  local sw, sf = tb_start(s, now)
  local amount = min(cost, s.B)
  local cw, cf = tb_span(s, amount)
  local nw, nf = tb_add(q, sw, sf, cw, cf)
  if not tb_le(nw, nf, hw, hf) then
    amount = tb_room(s, hw, hf, sw, sf)
    cw, cf = tb_span(s, amount)
    nw, nf = tb_add(q, sw, sf, cw, cf)
  end
  tb_store(s, now, nw, nf)
  local mw, mf = tb_add(q, nw, nf, s.off, 0)
  return mw, mf, amount, s.born
end

function token_bucket.settle(s, now, delta, mark, frac, amount, _, life)
  if delta == 0 then return mark, frac, amount end
  -- Not clamped: the charge may have been made under numbers a redeploy has
  -- replaced, and the state decided since under larger ones (see
  -- token_bucket.rs).
  tb_in_unit(s, now)
  local q = s.q
  if delta > 0 then
    local hw, hf = tb_add(q, now, 0, s.Ww, s.Wf)
    local sw, sf = tb_start(s, now)
    local extra = min(delta, tb_room(s, hw, hf, sw, sf))
    if extra > 0 then
      local cw, cf = tb_span(s, extra)
      tb_store(s, now, tb_add(q, sw, sf, cw, cf))
    end
    return mark, frac, amount
  end
  -- A charge of another life of the state (one Redis lost) holds nothing
  -- in this one.
  if life ~= s.born then return mark, frac, amount end
  -- The state's own time: a clock set back refunds nothing extra.
  local ref = max(now, s.last)
  if tb_le(s.tat, s.frac, ref, 0) then return mark, frac, amount end
  local held = tb_tokens(s, tb_sub(q, s.tat, s.frac, ref, 0))
  local ef = frac
  if ef >= q then ef = 0 end
  -- The hold's segment (mark - length, mark], from `seen` = now on the hold
  -- timeline.
  local lw, lf = tb_span(s, min(amount, s.B))
  local fw, ff = 0, 0
  if tb_le(lw, lf, mark, ef) then fw, ff = tb_sub(q, mark, ef, lw, lf) end
  local seen = ref + s.off
  if tb_le(fw, ff, seen, 0) then fw, ff = seen, 0 end
  local ahead = 0
  if not tb_le(mark, ef, fw, ff) then
    ahead = tb_tokens(s, tb_sub(q, mark, ef, fw, ff))
  end
  local refund = min(min(-delta, amount), min(ahead, held))
  if refund <= 0 then return mark, frac, amount end
  local cw, cf = tb_span(s, refund)
  local shift = tb_ceil(cw, cf)
  if shift > sat_sub(TB_MAX_OFFSET, s.off) then return mark, frac, amount end
  s.tat, s.frac = tb_sub(q, s.tat, s.frac, cw, cf)
  s.den = s.unit
  s.last = ref
  s.off = s.off + shift
  s.dirty = true
  -- Same mark: against the raised offset, the hold's segment is now the
  -- tokens it still holds.
  return mark, frac, amount - refund
end

function token_bucket.fresh_at(s)
  local at = s.tat + s.off
  if s.frac > 0 then at = at + 1 end
  return at
end

function token_bucket.save(s, now, _)
  local ttl = ttl_ms(token_bucket.fresh_at(s), now)
  if ttl == nil then
    if s.exists then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  local value = string.format('%.0f:%.0f:%.0f:%.0f:%.0f:%.0f', s.tat, s.frac, s.den, s.off,
    s.last, s.born)
  redis.call('SET', s.key, value, 'PX', ttl)
end
