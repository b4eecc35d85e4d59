-- On the DONOR's Redis: gives back a debit that can never be credited
-- because the receiver already holds a credit under the same id from an
-- earlier state of this donor (regions_credit.lua replied 3). The receiver
-- refuses that debit for good, so giving it back cannot count it twice.
--
-- KEYS[1]  state hash
-- KEYS[2]  debits hash
-- KEYS[3]  pending hash
-- ARGV[1]  transfer id
-- ARGV[2]  the debit record, exactly as regions_debit.lua wrote it
--
-- Reply: 1 given back now; 0 nothing changed (already given back, or the
-- record is not this state's: the donor lost its data again).
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec ~= ARGV[2] then
  return 0
end
local amount, epoch = string.match(rec, '^(%d+):[^:]+:%d+:([^:]*):')
local state = redis.call('HMGET', KEYS[1], 'alloc', 'epoch')
if not state[1] or state[2] ~= epoch then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'alloc', amount)
redis.call('HINCRBY', KEYS[1], 'debited', '-' .. amount)
redis.call('HSET', KEYS[2], ARGV[1], rec .. ':refunded')
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
