-- tower-admission: one atomic decision for every policy of a quota.
--
-- The script is the concatenation of a clock, common.lua, the four algorithm
-- files and this driver, run by EVALSHA. All keys of one decision share one
-- hash tag, prefix:{quota:key}:policy:algo, so Redis Cluster keeps them on one
-- slot and the script runs on one node, atomically.
--
-- KEYS[i]: the key of policy i.
-- ARGV[1]: 'd' (decide: cleanup, check every policy, record in the ones that
--          admitted if no enforcing policy refused) or 'a' (adjust).
-- ARGV[2]: the cost (decide) or the signed delta (adjust).
-- ARGV[3]: the injected time in µs for the test-only clock; ignored by the
--          production clock, which reads TIME.
-- ARGV[4 + 4(i-1) ..]: policy i as algorithm ('fw', 'sl', 'tb', 'sw'),
--          shadow ('1' or '0'), limit or capacity, window or refill interval (µs).
--
-- Decide returns { admitted, then per policy: admitted, remaining,
-- retry_after (µs, -1 for none), reset (µs) }. Adjust returns { 1 }.
-- Nothing is written before every argument has been read, so a refusal
-- consumes nothing and an error leaves the state as it was. A state that is
-- equivalent to fresh (fresh_at <= now) is deleted by every call that finds
-- it, exactly as its expiry would delete it in Redis time.

local algorithms = {
  fw = fixed_window, sl = sliding_log, tb = token_bucket, sw = sliding_window,
}

local op = ARGV[1]
local amount = tonumber(ARGV[2])
local now = clock_now()
if amount == nil or now == nil or (op ~= 'd' and op ~= 'a') then
  return redis.error_reply('ERR tower-admission: bad arguments')
end

local policies = {}
for i = 1, #KEYS do
  local base = 3 + (i - 1) * 4
  local algo = algorithms[ARGV[base + 1]]
  local a = tonumber(ARGV[base + 3])
  local b = tonumber(ARGV[base + 4])
  if algo == nil or a == nil or b == nil or b < 1 then
    return redis.error_reply('ERR tower-admission: bad policy ' .. i)
  end
  policies[i] = { algo = algo, shadow = ARGV[base + 2] == '1', state = algo.load(KEYS[i], a, b) }
end

if op == 'a' then
  for _, p in ipairs(policies) do
    p.algo.adjust(p.state, now, amount)
    p.algo.save(p.state, now)
  end
  return { 1 }
end

local out = { 1 }
for _, p in ipairs(policies) do
  local admitted, remaining, retry_after, reset = p.algo.check(p.state, now, amount)
  p.admitted = admitted == 1
  if not p.admitted and not p.shadow then out[1] = 0 end
  out[#out + 1] = admitted
  out[#out + 1] = remaining
  out[#out + 1] = retry_after
  out[#out + 1] = reset
end
if out[1] == 1 then
  for _, p in ipairs(policies) do
    if p.admitted then p.algo.record(p.state, now, amount) end
  end
end
for _, p in ipairs(policies) do
  p.algo.save(p.state, now)
end
return out
