-- Gives a region back the allocation lost with a state loss (after the
-- clock prelude), once per reading: `restore_lost` computed the amount from
-- a consistent cut of every region, and the `restores` counter it read
-- there must be unchanged (another restore since would have counted it).
-- The amount is held for H like a credit, so it is not spent while grants
-- issued before the loss may still be in use.
--
-- KEYS[1]  state hash
-- ARGV[1]  the region's epoch in the cut
-- ARGV[2]  `restores` in the cut
-- ARGV[3]  the amount, a positive integer
--
-- Reply: {1, alloc} restored; {0} the state changed under the reading
-- (another restore, or another life): read again.
local state = redis.call('HMGET', KEYS[1], 'alloc', 'epoch', 'restores', 'hold')
if not state[1] or state[2] ~= ARGV[1] or (state[3] or '0') ~= ARGV[2] then
  return {0}
end
local now = clock_now()
local hold = state[4] or ''
if hold ~= '' then
  hold = hold .. ','
end
local alloc = redis.call('HINCRBY', KEYS[1], 'alloc', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'restores', 1)
redis.call('HSET', KEYS[1], 'hold', hold .. string.format('%d', now) .. ':' .. ARGV[3])
return {1, alloc}
