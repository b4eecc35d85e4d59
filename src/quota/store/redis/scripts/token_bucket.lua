-- tower-admission: token bucket as GCRA, capacity B, one token every I µs.
-- Mirrors src/quota/algorithm/token_bucket.rs decision for decision.
--
-- Key: a string holding `tat`, the theoretical arrival time in µs (an
-- integer, so a long-running key never drifts). The bucket is full at and
-- after `tat`, so the key expires at `tat`.

local token_bucket = {}

function token_bucket.load(key, capacity, interval)
  local tat = redis.call('GET', key)
  return {
    key = key, capacity = capacity, interval = interval,
    tat = tonumber(tat) or 0, exists = tat ~= false, dirty = false,
  }
end

local function tb_horizon(s, now)
  return now + s.capacity * s.interval
end

function token_bucket.check(s, now, cost)
  local start = max(s.tat, now)
  local horizon = tb_horizon(s, now)
  local remaining = idiv(sat_sub(horizon, start), s.interval)
  if cost > s.capacity then return 0, remaining, -1, start - now end
  local next_tat = start + cost * s.interval
  if next_tat <= horizon then
    return 1, idiv(horizon - next_tat, s.interval), -1, next_tat - now
  end
  return 0, remaining, next_tat - horizon, start - now
end

function token_bucket.record(s, now, cost)
  local next_tat = max(s.tat, now) + cost * s.interval
  s.tat = min(next_tat, max(tb_horizon(s, now), s.tat))
  s.dirty = true
  return s.tat, 0, cost
end

function token_bucket.settle(s, now, delta, mark, frac, amount)
  token_bucket.adjust(s, now, delta)
  return mark, frac, amount
end

function token_bucket.adjust(s, now, delta)
  if delta >= 0 then
    local start = max(s.tat, now)
    s.tat = min(start + delta * s.interval, max(tb_horizon(s, now), start))
  elseif s.tat > now then
    s.tat = max(s.tat + delta * s.interval, now)
  end
  s.dirty = true
end

function token_bucket.fresh_at(s)
  return s.tat
end

function token_bucket.save(s, now)
  local ttl = ttl_ms(s.tat, now)
  if ttl == nil then
    if s.exists then redis.call('DEL', s.key) end
    return
  end
  if not s.dirty then return end
  redis.call('SET', s.key, s.tat, 'PX', ttl)
end
