-- tower-admission: one atomic decision for every policy of a quota.
--
-- The script is the concatenation of the prelude of src/redis/scripts (a
-- clock, common.lua), the four algorithm files and this driver, run by
-- EVALSHA. All keys of one decision share one
-- hash tag, prefix:{quota:key}:policy:algo, so Redis Cluster keeps them on one
-- slot and the script runs on one node, atomically. The Rust memory store
-- applies the same rule (check all, then record all) in
-- src/quota/store/memory.rs; the differential tests compare the two stores.
--
-- KEYS[i]: the key of policy i (n policies: 5 arguments each from ARGV[4],
--          and 3 more each for a settle).
-- KEYS[n + 1], given when a policy is a sliding log or weighted window: the
--          quota key's expiry, a string of µs. It is the memory store's one
--          expiry of the key's slot: after a decision the latest time a
--          policy's state becomes fresh, after a settle never earlier than
--          before (unless every state is fresh). A settle reads a log or
--          weighted window as fresh only once it has passed and the state
--          is fresh under the settle's numbers too: their freshness
--          depends on the window, and the settle's numbers may be older than
--          those that decided the state since. Without it (none kept yet, or
--          Redis expired it) a settle reads each state as it stands.
-- ARGV[1]: 'd' (decide: cleanup, check every policy, record in the ones that
--          admitted if no enforcing policy refused), 'p' (peek: the answer
--          'd' would give, writing nothing) or 's' (settle).
-- ARGV[2]: the cost (decide) or the signed delta (settle).
-- ARGV[3]: the injected time in µs for the test-only clock; ignored by the
--          production clock, which reads TIME.
-- ARGV[4 + 5(i-1) ..]: policy i as algorithm ('fw', 'sl', 'tb', 'sw'),
--          shadow ('1' or '0'), and the algorithm's three numbers.
-- Settle only, ARGV[4 + 5n + 4(i-1) ..]: policy i's hold (mark, frac, amount,
--          life).
--
-- Decide returns { admitted, then per policy: admitted, remaining,
-- retry_after (µs, -1 for none), reset (µs), and the hold: mark, frac,
-- amount, life (zeros when nothing was recorded) }. On a refusal a policy that
-- would have admitted reports its state as it stands (a check of cost 0). Settle returns per policy the
-- hold after it: mark, frac, amount, life.
-- Nothing is written before every argument has been read, so a refusal
-- consumes nothing and an error leaves the state as it was. A state that is
-- equivalent to fresh (fresh_at <= now) is deleted by every decision that
-- finds it, exactly as its expiry would delete it in Redis time. A settle
-- deletes only a state it leaves fresh, and never brings a key's expiry
-- forward.

local algorithms = {
  fw = fixed_window, sl = sliding_log, tb = token_bucket, sw = sliding_window,
}

local op = ARGV[1]
local amount = tonumber(ARGV[2])
local now = clock_now()
if amount == nil or now == nil or (op ~= 'd' and op ~= 'p' and op ~= 's') then
  return redis.error_reply('ERR tower-admission: bad arguments')
end

local per = 5
if op == 's' then per = 9 end
local n = (#ARGV - 3) / per
if n ~= math.floor(n) or n < 1 or n > #KEYS then
  return redis.error_reply('ERR tower-admission: bad arguments')
end
local expiry_key = KEYS[n + 1]
local policies = {}
for i = 1, n do
  local base = 3 + (i - 1) * 5
  local algo = algorithms[ARGV[base + 1]]
  local a = tonumber(ARGV[base + 3])
  local b = tonumber(ARGV[base + 4])
  local c = tonumber(ARGV[base + 5])
  if algo == nil or a == nil or b == nil or c == nil or b < 1 then
    return redis.error_reply('ERR tower-admission: bad policy ' .. i)
  end
  policies[i] = { algo = algo, shadow = ARGV[base + 2] == '1', state = algo.load(KEYS[i], a, b, c) }
end

-- The quota key's expiry before this call; nil if none is kept (all its
-- states are fresh, or were written by a script that kept none: then they
-- are read as they stand, never dropped).
local expiry = nil
if expiry_key then expiry = tonumber(redis.call('GET', expiry_key)) end

-- The quota key's expiry after this call: the latest time a policy's state
-- becomes fresh; after a settle never earlier than before, unless every
-- state is fresh. 0 without an expiry key.
local function expiry_after(settled)
  if not expiry_key then return 0 end
  local after = 0
  for _, p in ipairs(policies) do after = max(after, p.algo.fresh_at(p.state)) end
  if settled and after > 0 then after = max(after, expiry or 0) end
  return after
end

-- Saves every policy's state and the quota key's expiry `after`.
local function save_all(settled, after)
  for _, p in ipairs(policies) do p.algo.save(p.state, now, settled, after) end
  if not expiry_key or after == expiry then return end
  local ttl = ttl_ms(after, now)
  -- Passed already (a settle keeps a log whose entries have left its
  -- window): only the injected clock's keys outlive it, by their pad.
  if ttl == nil and after > 0 and EXPIRY_PAD_MS > 0 then ttl = EXPIRY_PAD_MS end
  if ttl == nil then
    if expiry ~= nil then redis.call('DEL', expiry_key) end
    return
  end
  redis.call('SET', expiry_key, string.format('%.0f', after), 'PX', ttl)
end

if op == 's' then
  local whole_fresh = expiry ~= nil and expiry <= now
  local holds = {}
  for i = 1, n do
    local base = 3 + 5 * n + (i - 1) * 4
    local mark, frac, held = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
    local life = tonumber(ARGV[base + 4])
    if mark == nil or frac == nil or held == nil or life == nil then
      return redis.error_reply('ERR tower-admission: bad hold ' .. i)
    end
    holds[i] = { mark, frac, held, life }
  end
  local out = {}
  for i, p in ipairs(policies) do
    local mark, frac, held = p.algo.settle(
      p.state, now, amount, holds[i][1], holds[i][2], holds[i][3], whole_fresh, holds[i][4])
    out[#out + 1] = mark
    out[#out + 1] = frac
    out[#out + 1] = held
    out[#out + 1] = holds[i][4]
  end
  save_all(true, expiry_after(true))
  return out
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
  out[#out + 1] = 0
  out[#out + 1] = 0
  out[#out + 1] = 0
  out[#out + 1] = 0
end
for i, p in ipairs(policies) do
  local base = 1 + (i - 1) * 8
  if p.admitted and out[1] == 1 then
    if op == 'd' then
      local mark, frac, held, life = p.algo.record(p.state, now, amount)
      out[base + 5] = mark
      out[base + 6] = frac
      out[base + 7] = held
      out[base + 8] = life or 0
    end
  elseif p.admitted then
    -- Nothing recorded: the policy reports its state as it stands, as a
    -- check of nothing finds it.
    local _, remaining, _, reset = p.algo.check(p.state, now, 0)
    out[base + 2] = remaining
    out[base + 4] = reset
  end
end
if op == 'd' then save_all(false, expiry_after(false)) end
return out
