-- Step 1 of an ORDERED transfer, on the DONOR's Redis (after the clock
-- prelude): the n-th transfer from this region to one receiver. Ordered
-- transfers keep bounded records: per receiver, the last number debited and
-- its record; a number at or below it is answered from that, never debited
-- again.
--
-- KEYS[1]  state hash: alloc, debited, credited, seq, epoch, from:<region>,
--          hold, out:<to> (last number debited toward <to>), last:<to>
--          (its record)
-- KEYS[2]  pending hash: "~<to>~<n>" -> record, until the credit is confirmed
-- ARGV[1]  receiver region
-- ARGV[2]  n, the transfer's number in this pair, from 1
-- ARGV[3]  amount, a positive integer below 2^53
-- ARGV[4]  the receiver's epoch: the credit lands only in that state of it;
--          empty to look the number up only
-- ARGV[5]  the credit hold H (µs): allocation received less than H ago is
--          not yet this region's to give
--
-- A record is "<amount>:<to>:<seq>:<epoch>:<to epoch>", as regions_debit.lua
-- writes it, so repair reads both kinds alike.
--
-- Reply (nothing is written unless the reply starts with 1):
--   {1, seq, epoch}        debited now
--   {2, record, pending}   n is the last number debited: its record, and 1
--                          if its credit is still unconfirmed
--   {4}                    n is below the last number debited: applied (or
--                          dropped) long ago, its record compacted away
--   {0, available}         refused: the spendable allocation is below the amount
--   {-1}                   no state hash
--   {-2}                   ARGV[4] is empty and n was never debited
--   {-3, last}             n is not the next number (last + 1)
--   {-4, last}             the last transfer toward this receiver is not yet
--                          confirmed: no new one until it is
local to, to_epoch = ARGV[1], ARGV[4]
local n, amount, hold_us = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
if not amount or amount < 1 or amount ~= math.floor(amount) then
  return redis.error_reply('ERR regions: amount must be a positive integer')
end
if not n or n < 1 or n ~= math.floor(n) then
  return redis.error_reply('ERR regions: the transfer number must be a positive integer')
end
local state = redis.call('HMGET', KEYS[1], 'alloc', 'epoch', 'out:' .. to, 'last:' .. to, 'hold')
if not state[1] then
  return {-1}
end
local last = tonumber(state[3] or '0')
if n == last then
  local pending = redis.call('HEXISTS', KEYS[2], '~' .. to .. '~' .. last)
  return {2, state[4], pending}
end
if n < last then
  return {4}
end
if n ~= last + 1 then
  return {-3, last}
end
if last > 0 and redis.call('HEXISTS', KEYS[2], '~' .. to .. '~' .. last) == 1 then
  return {-4, last}
end
if to_epoch == '' then
  return {-2}
end

-- What was received less than H ago stays out of reach.
local now = clock_now()
local held = 0
for t, a in string.gmatch(state[5] or '', '(%d+):(%d+)') do
  if tonumber(t) + hold_us > now then
    held = held + tonumber(a)
  end
end
local available = sat_sub(tonumber(state[1]), held)
if available < amount then
  return {0, available}
end

redis.call('HINCRBY', KEYS[1], 'alloc', '-' .. ARGV[3])
redis.call('HINCRBY', KEYS[1], 'debited', ARGV[3])
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
local rec = ARGV[3] .. ':' .. to .. ':' .. seq .. ':' .. (state[2] or '') .. ':' .. to_epoch
redis.call('HSET', KEYS[1], 'out:' .. to, n, 'last:' .. to, rec)
redis.call('HSET', KEYS[2], '~' .. to .. '~' .. n, rec)
return {1, seq, state[2] or ''}
