-- A region's allocation as its instances may spend it (after the clock
-- prelude), read only: the allocation less what was received less than H
-- ago.
--
-- KEYS[1]  state hash
-- ARGV[1]  the credit hold H (µs)
--
-- Reply: {alloc, held, now_us, epoch}, or {-1} if there is no state hash.
local state = redis.call('HMGET', KEYS[1], 'alloc', 'hold', 'epoch')
if not state[1] then
  return {-1}
end
local now = clock_now()
local hold_us = tonumber(ARGV[1])
local held = 0
for t, a in string.gmatch(state[2] or '', '(%d+):(%d+)') do
  if tonumber(t) + hold_us > now then
    held = held + tonumber(a)
  end
end
return {tonumber(state[1]), held, now, state[3] or ''}
