-- tower-admission: the grant server of rate leases, one atomic call.
--
-- The Rust side prepends the prelude of src/redis/scripts: a clock,
-- `clock_now()` (Redis TIME in µs in production; ARGV[9] in the test-only
-- script, a different SHA) and EXPIRY_PAD_MS (0 in production), then the
-- integer helpers of common.lua (`idiv` and the rest).
--
-- KEYS[1]: the budget's key, prefix:{lease:budget}, a hash:
--   `_t`       the last time the script ran (µs): time never moves backwards;
--   `x:<id>`   a released instance: "<life>:<until>". Until then a grant call
--              of that life (one sent before the release, reaching Redis
--              late) changes nothing; one of another life (a new lease under
--              the same id) clears it.
--   `i:<id>`   one instance: "demand,provisional,rate1,exp1,rate2,exp2,...,budget,o<life>"
--              (milli-units per second, 0/1/2, µs, milli-units per second,
--              the life of the lease that holds the id).
--              The (rate, exp) pairs are the instance's
--              *steps*: every grant it may still be spending, each counted
--              until its expiry. Kept sorted by expiry with strictly
--              decreasing rates (a step with a lower rate and an earlier
--              expiry than another is implied by it and dropped). The
--              trailing `budget` is the R the instance last called with
--              (absent in records written before it was kept: an odd
--              count of numbers has it). The trailing `o<life>` names the
--              lease that holds the id (absent in records written before
--              it was kept: such a record is taken by its next caller). It
--              is no number, so a script that predates it skips it.
--              After it, `q<n>`: the number of the holder's latest call
--              (absent: none numbered).
-- ARGV[1]: 'g' (grant), 'r' (release) or 's' (snapshot, read only).
-- ARGV[2]: the instance id.
-- ARGV[3]: its demand (milli-units/s); ARGV[4]: 1 if that demand is a guess
-- (nothing measured yet), 2 if held back by its grant twice in a row, 3 if
-- once, else 0; ARGV[5]: the
-- budget R (milli-units/s);
-- ARGV[6]: the lease length L (µs).
-- ARGV[7], ARGV[8]: the grant the instance holds by its own account (rate,
--          µs it still has), 0 0 for none. Merged as a step: after a lost
--          state (Redis restarted empty) the grants still being spent are
--          counted again from their holders' first call.
-- ARGV[9]: the injected time (test-only script). ARGV[10]: the calling
--          lease's life, random per lease (16 hex digits). ARGV[11]: 1 if
--          the dependency pushed back on the caller since its last call
--          (absent or 0: it did not). ARGV[12], ARGV[13]: an older, higher
--          grant the caller still spends by its own account (rate, µs it
--          still has; absent or 0 0 for none), merged as a step as ARGV[7],
--          ARGV[8] are. ARGV[14]: a rate (milli-units/s) the caller
--          stopped spending above before it sent the call: its steps are
--          lowered to it (absent or 0: they are not). ARGV[15]:
--          the call's number in its lease's life, counting from 1 (absent
--          or 0: not numbered).
--
-- `_a` in the hash: "<base>,<pushed>,<cut>", the pushback state (absent: no
-- pushback, E = R). Pushback (AIMD on the budget the targets share): the
-- effective budget E is `base` until PB_QUIET after the last pushback
-- `pushed`, then grows as base + R/60 per s² × (time since then)², up to R.
-- A call that reports pushback sets `pushed` = now and `base` = E(now),
-- halved (at least R/10) when the last halving `cut` is PB_COOLDOWN old:
-- one halving per cooldown for the whole fleet, however many instances saw
-- the refusals. Targets share E; the headroom check stays on R, so E only
-- ever lowers grants.
--
-- One id, one holder. A grant call whose id's record has a step not yet
-- expired and names another life (a second live process configured with
-- the same id, or a restarted one while its old grants run) is refused: it
-- writes nothing and returns { 0, 0, now, 0, 0, live, until }, with `until`
-- the holder's last expiry, when the id is free again unless the holder
-- renews. Two processes with one id would otherwise each spend the id's
-- whole grant, while the script counts it once.
--
-- The rule. An instance's commitment at time t is the highest rate of its
-- steps that expire after t. Every profile is non-increasing in t, so the
-- sum over instances is highest at the present. The budget of a call is
-- the lowest R of the caller and every live instance, so that during a
-- deploy that lowers R the instances still running the old one are held to
-- the new one (and a raised R applies once no live instance has the old
-- one). A grant of rate g to
-- instance j at `now` is at most that budget minus the others' commitments at `now`;
-- its own older steps stay: a lowered grant frees its surplus only at the
-- old step's expiry, because the instance keeps spending the old rate until
-- the reply reaches it (or the old lease ends). Hence at every time t >= now
-- the sum of commitments stays <= R (see docs/leases.md for the proof).
--
-- Shares: max-min fair over the demands of the live instances (those with a
-- step not yet expired, plus the caller): every instance's target is
-- min(demand, lambda), with lambda the water level at which the targets sum
-- to R (no cap when the demands fit). The grant is min(target, headroom).
-- Another instance's guessed demand counts as R when the caller's target is
-- computed: a guess must not let the caller take what that instance may
-- need, since capacity once granted is stranded for a lease length. One
-- held back once counts as half itself (one such window is as often a
-- burst as growth); one held back twice in a row counts as twice itself,
-- at most R: room for its next doubling, without stranding the rest; but
-- as it asks when the caller is held back twice in a row too (no room
-- kept for one another).
-- Such a caller may also take its own room at once from what no demand
-- asks (see the rule at `want`).
--
-- 'g' returns { grant, expiry, now, recheck, target, live, 0, E }: the grant rate
-- and its expiry (µs), the script's time, and, when the grant is below the
-- target, the earliest time (µs) at which the target should fit, from the
-- other instances' steps and targets (0 when it fits now or never will),
-- and the effective budget E (R without pushback).
-- A lowered call (ARGV[14] = c > 0): the caller stopped spending above c
-- before sending, so each of its steps is lowered to c before the grant is
-- computed (the grant too is at most c), and the surplus is free at once
-- instead of at the steps' expiries. A numbered call older than one already
-- run for the same life (sent before it on a connection that hung, reaching
-- Redis after it) writes nothing and returns { 0, now, now, 0, 0, live, 0,
-- 0 }: its reply is gone, and its lowering must not undo the grant of the
-- newer call, which the caller may be spending.
--
-- 'r' deletes the instance if the caller's life holds it (its holder has
-- stopped spending; another life's grants stay counted), leaves its `x:`
-- mark for L, and returns { now }. A grant call that finds its own life's
-- mark returns { 0, now, now, 0, 0, live, 0, 0 } and writes nothing. 's' returns { now, n, then per instance: id, demand, flag
-- (as ARGV[4]), #steps, rate1, exp1, ... }.

local key = KEYS[1]
local op = ARGV[1]
local me = 'i:' .. (ARGV[2] or '')
local mark = 'x:' .. (ARGV[2] or '')
local life = ARGV[10] or ''
local marks = {}
local demand = tonumber(ARGV[3])
local flag = tonumber(ARGV[4]) or 0
local R = tonumber(ARGV[5])
local L = tonumber(ARGV[6])
local held_rate = tonumber(ARGV[7])
local held_left = tonumber(ARGV[8])
local pushed = tonumber(ARGV[11] or '0') or 0
local lowered = tonumber(ARGV[14] or '0') or 0
local call_no = tonumber(ARGV[15] or '0') or 0
local PB_QUIET = 3000000
local PB_COOLDOWN = 2000000
local now = clock_now()
if now == nil or demand == nil or R == nil or L == nil or held_rate == nil
    or held_left == nil or (op ~= 'g' and op ~= 'r' and op ~= 's') then
  return redis.error_reply('ERR tower-admission lease: bad arguments')
end

local last = tonumber(redis.call('HGET', key, '_t') or '0') or 0
if last > now then now = last end

-- The steps of `value` that still count after `now`, its holder's life and
-- the number of the holder's latest call (nil in a record that predates
-- them).
local function parse(value)
  local nums = {}
  local owner, numbered = nil, nil
  for s in string.gmatch(value, '[^,]+') do
    local head = string.sub(s, 1, 1)
    if head == 'o' then
      owner = string.sub(s, 2)
    elseif head == 'q' then
      numbered = tonumber(string.sub(s, 2))
    else
      nums[#nums + 1] = tonumber(s)
    end
  end
  local steps = {}
  for k = 3, #nums - 1, 2 do
    if nums[k + 1] > now then steps[#steps + 1] = { nums[k], nums[k + 1] } end
  end
  local budget = nil
  if #nums >= 3 and #nums % 2 == 1 then budget = nums[#nums] end
  return nums[1] or 0, nums[2] or 0, steps, budget, owner, numbered
end

local function encode(d, g, steps, budget, owner, numbered)
  local parts = { string.format('%d', d), string.format('%d', g) }
  for _, s in ipairs(steps) do
    parts[#parts + 1] = string.format('%d', s[1])
    parts[#parts + 1] = string.format('%d', s[2])
  end
  parts[#parts + 1] = string.format('%d', budget)
  parts[#parts + 1] = 'o' .. owner
  if numbered ~= nil and numbered > 0 then
    parts[#parts + 1] = 'q' .. string.format('%d', numbered)
  end
  return table.concat(parts, ',')
end

-- The commitment at time t: the highest rate among steps expiring after t.
local function commit(steps, t)
  local c = 0
  for _, s in ipairs(steps) do
    if s[2] > t and s[1] > c then c = s[1] end
  end
  return c
end

-- Drops implied steps; the result is sorted by expiry, rates decreasing.
local function prune(steps)
  table.sort(steps, function(a, b)
    if a[2] ~= b[2] then return a[2] < b[2] end
    return a[1] < b[1]
  end)
  local kept, best = {}, -1
  for k = #steps, 1, -1 do
    if steps[k][1] > best then
      table.insert(kept, 1, steps[k])
      best = steps[k][1]
    end
  end
  return kept
end

local ids, dem, flags, steps, budgets, owners, numbers = {}, {}, {}, {}, {}, {}, {}
local aimd = nil
local all = redis.call('HGETALL', key)
for k = 1, #all, 2 do
  local f = all[k]
  if string.sub(f, 1, 2) == 'x:' then
    local l, u = string.match(all[k + 1], '^([^:]*):(%d+)$')
    if u ~= nil and tonumber(u) > now then
      marks[f] = { l, tonumber(u) }
    elseif op ~= 's' then
      redis.call('HDEL', key, f)
    end
  elseif f == '_a' then
    local b, p, c = string.match(all[k + 1], '^(%d+),(%d+),(%d+)$')
    if b ~= nil then aimd = { tonumber(b), tonumber(p), tonumber(c) } end
  elseif f ~= '_t' then
    local d, g, st, b, o, q = parse(all[k + 1])
    if #st > 0 or f == me then
      ids[#ids + 1] = f
      dem[f] = d
      flags[f] = g
      steps[f] = st
      budgets[f] = b
      owners[f] = o
      numbers[f] = q
    elseif op ~= 's' then
      -- Every grant of this instance has expired: it is gone.
      redis.call('HDEL', key, f)
    end
  end
end

if op == 's' then
  local out = { now, #ids }
  for _, f in ipairs(ids) do
    out[#out + 1] = string.sub(f, 3)
    out[#out + 1] = dem[f]
    out[#out + 1] = flags[f]
    out[#out + 1] = #steps[f]
    for _, s in ipairs(steps[f]) do
      out[#out + 1] = s[1]
      out[#out + 1] = s[2]
    end
  end
  return out
end

-- Sets the key's expiry to the last step's or mark's, or deletes a key
-- with neither.
local function save_time()
  local horizon = now
  for _, f in ipairs(ids) do
    for _, s in ipairs(steps[f]) do
      if s[2] > horizon then horizon = s[2] end
    end
  end
  for _, m in pairs(marks) do
    if m[2] > horizon then horizon = m[2] end
  end
  if horizon <= now then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, '_t', string.format('%d', now))
  redis.call('PEXPIRE', key, idiv(horizon - now + 999, 1000) + EXPIRY_PAD_MS)
end

-- Whether the id's record has a grant not yet expired under another life.
local function held_by_other()
  return steps[me] ~= nil and #steps[me] > 0 and owners[me] ~= nil
    and owners[me] ~= life
end

if op == 'r' then
  if steps[me] ~= nil and not held_by_other() then
    redis.call('HDEL', key, me)
    local rest = {}
    for _, f in ipairs(ids) do
      if f ~= me then rest[#rest + 1] = f end
    end
    ids = rest
  end
  if L > 0 then
    marks[mark] = { life, now + L }
    redis.call('HSET', key, mark, life .. ':' .. string.format('%d', now + L))
  end
  save_time()
  return { now }
end

-- op == 'g'
local released = marks[mark]
if released ~= nil then
  if released[1] == life then
    return { 0, now, now, 0, 0, #ids, 0, 0 }
  end
  marks[mark] = nil
  redis.call('HDEL', key, mark)
end
if held_by_other() then
  local until_t = now
  for _, s in ipairs(steps[me]) do
    if s[2] > until_t then until_t = s[2] end
  end
  return { 0, 0, now, 0, 0, #ids, until_t, 0 }
end
if call_no > 0 and owners[me] == life and numbers[me] ~= nil
    and call_no <= numbers[me] then
  return { 0, now, now, 0, 0, #ids, 0, 0 }
end
if steps[me] == nil then
  ids[#ids + 1] = me
  steps[me] = {}
end
dem[me] = demand
flags[me] = flag
if held_rate > 0 and held_left > 0 then
  table.insert(steps[me], { held_rate, now + held_left })
end
local kept_rate = tonumber(ARGV[12] or '0') or 0
local kept_left = tonumber(ARGV[13] or '0') or 0
if kept_rate > 0 and kept_left > 0 then
  table.insert(steps[me], { kept_rate, now + kept_left })
end
if lowered > 0 then
  for _, s in ipairs(steps[me]) do
    if s[1] > lowered then s[1] = lowered end
  end
end

-- The budget of this call: the lowest of the caller's and every other live
-- instance's (a deploy may be changing it).
local budget = R
for _, f in ipairs(ids) do
  if f ~= me and budgets[f] ~= nil and budgets[f] < budget then budget = budgets[f] end
end

-- The effective budget E at now (see `_a` above), and the pushback this
-- call reports.
local function effective()
  if aimd == nil then return budget end
  local quiet = now - aimd[2] - PB_QUIET
  if quiet <= 0 then return min(aimd[1], budget) end
  local q_ms = idiv(quiet, 1000)
  if q_ms >= 7746 then return budget end
  return min(budget, aimd[1] + muldiv(budget, q_ms * q_ms, 60000000))
end
local E = effective()
if pushed > 0 then
  local cut = -PB_COOLDOWN
  if aimd ~= nil then cut = aimd[3] end
  if now - cut >= PB_COOLDOWN then
    E = max(idiv(budget, 10), idiv(E, 2))
    cut = now
  end
  aimd = { E, now, cut }
end
if aimd ~= nil and E >= budget and pushed == 0 then
  aimd = nil
  redis.call('HDEL', key, '_a')
elseif aimd ~= nil then
  redis.call('HSET', key, '_a', string.format('%d,%d,%d', aimd[1], aimd[2], aimd[3]))
end

-- The max-min fair water level over the demands `eff` of the live
-- instances, sharing E (nil: every demand fits).
local function level(eff)
  local order = {}
  for _, f in ipairs(ids) do order[#order + 1] = f end
  table.sort(order, function(a, b) return eff[a] < eff[b] end)
  local remaining = E
  for k, f in ipairs(order) do
    local share = idiv(remaining, #order - k + 1)
    if eff[f] <= share then
      remaining = remaining - eff[f]
    else
      return share
    end
  end
  return nil
end

-- The targets: the water level over the live demands, another instance's
-- guessed demand counted as E, one held back once as half itself (about
-- the grant it was held back at: one such window is as often a burst as
-- growth), one held back twice in a row as twice itself (room for its next
-- doubling), except by a caller held back twice in a row too: among
-- those, each counts as it asks.
local eff = {}
for _, f in ipairs(ids) do
  if f == me or flags[f] == 0 or (flags[f] == 2 and flag == 2) then
    eff[f] = math.min(E, dem[f])
  elseif flags[f] == 3 then
    eff[f] = math.min(E, idiv(dem[f], 2))
  elseif flags[f] == 2 then
    eff[f] = math.min(E, 2 * dem[f])
  else
    eff[f] = E
  end
end
local lambda = level(eff)
local function target(f)
  if lambda ~= nil and eff[f] > lambda then return lambda end
  return eff[f]
end

-- A caller held back twice in a row may also take, up to twice its
-- demand (the room the others' targets keep for it), its part of what no
-- demand asks (each counted once, a guess as E), shared with every other
-- instance held back (once or twice), and at most the water level at
-- which all their demands are unbounded: what instances leave (scaled
-- down, or quieter) goes to the ones held back by their next calls, not
-- one doubling per call.
local want = target(me)
if flag == 2 then
  local asked, growers, open = 0, 0, {}
  for _, f in ipairs(ids) do
    if flags[f] == 1 and f ~= me then
      asked = asked + E
    else
      asked = asked + math.min(E, dem[f])
    end
    if flags[f] == 2 or flags[f] == 3 then
      growers = growers + 1
      open[f] = E
    else
      open[f] = eff[f]
    end
  end
  if asked < E then
    local more = math.min(2 * dem[me], dem[me] + idiv(E - asked, growers))
    local cap = level(open)
    if cap ~= nil and more > cap then more = cap end
    if more > E then more = E end
    if more > want then want = more end
  end
end

local others = 0
for _, f in ipairs(ids) do
  if f ~= me then others = others + commit(steps[f], now) end
end
local grant = budget - others
if grant > want then grant = want end
if lowered > 0 and grant > lowered then grant = lowered end
if grant < 0 then grant = 0 end
local expiry = now + L
table.insert(steps[me], { grant, expiry })
steps[me] = prune(steps[me])

-- When the target does not fit yet: the first time it should, if every
-- other instance renews at its own target and its older steps run out.
local recheck = 0
if grant < want then
  local times = {}
  for _, f in ipairs(ids) do
    if f ~= me then
      for _, s in ipairs(steps[f]) do times[#times + 1] = s[2] end
    end
  end
  table.sort(times)
  for _, t in ipairs(times) do
    local sum = 0
    for _, f in ipairs(ids) do
      if f ~= me then
        local c = commit(steps[f], t)
        local tf = target(f)
        if tf > c then c = tf end
        sum = sum + c
      end
    end
    if sum + want <= budget then
      recheck = t
      break
    end
  end
end

local numbered = numbers[me]
if owners[me] ~= life then numbered = nil end
if call_no > 0 then numbered = call_no end
redis.call('HSET', key, me, encode(demand, flag, steps[me], R, life, numbered))
save_time()
return { grant, expiry, now, recheck, want, #ids, 0, E }
