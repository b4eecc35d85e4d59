-- Step 2 of an ORDERED transfer, on the RECEIVER's Redis (after the clock
-- prelude): add the amount once, and hold it for H before it counts as
-- spendable. Sent only after the donor confirmed the debit.
--
-- KEYS[1]  state hash: alloc, debited, credited, seq, epoch, from:<region>,
--          pin:<region>, hold ("<µs>:<amount>,..." credits younger than H),
--          in:<donor>:<donor epoch> (the highest number credited from that
--          life of the donor)
-- ARGV[1]  donor region
-- ARGV[2]  n, the transfer's number in the pair
-- ARGV[3]  amount, as recorded by the donor's debit
-- ARGV[4]  the debit's seq in the donor region
-- ARGV[5]  the donor's epoch
-- ARGV[6]  the receiver's epoch recorded by the debit
-- ARGV[7]  the credit hold H (µs)
--
-- The rule that bounds the records: a pair's transfers are debited in
-- order, the next only after the last one's credit is confirmed, so they
-- are credited in order too; the credit of n applies only if n is above the
-- watermark in:<donor>:<epoch>, which it then becomes. A late retry of any
-- number at or below the watermark changes nothing.
--
-- Reply (nothing is written unless the reply starts with 1):
--   {1, alloc}  credited now
--   {2}         credited before (n at or below the watermark)
--   {-1} {-2, epoch} {-3}  as regions_credit.lua: missing state, re-created
--               receiver, re-seeded donor; never credited
local state = redis.call('HMGET', KEYS[1], 'alloc', 'epoch', 'hold')
if not state[1] then
  return {-1}
end
if state[2] ~= ARGV[6] then
  return {-2, state[2] or ''}
end
local pin = redis.call('HGET', KEYS[1], 'pin:' .. ARGV[1])
if pin and pin ~= ARGV[5] then
  return {-3}
end
local mark = 'in:' .. ARGV[1] .. ':' .. ARGV[5]
local n = tonumber(ARGV[2])
if n <= tonumber(redis.call('HGET', KEYS[1], mark) or '0') then
  return {2}
end

local now = clock_now()
local hold_us = tonumber(ARGV[7])
local kept = {}
for t, a in string.gmatch(state[3] or '', '(%d+):(%d+)') do
  if tonumber(t) + hold_us > now then
    kept[#kept + 1] = t .. ':' .. a
  end
end
kept[#kept + 1] = string.format('%d', now) .. ':' .. ARGV[3]

local alloc = redis.call('HINCRBY', KEYS[1], 'alloc', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'credited', ARGV[3])
note_sent_seq(KEYS[1], ARGV[1], ARGV[4], ARGV[5])
redis.call('HSET', KEYS[1], mark, ARGV[2], 'hold', table.concat(kept, ','))
return {1, alloc}
