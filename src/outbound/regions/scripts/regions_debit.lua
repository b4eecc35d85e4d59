-- Step 1 of a regional transfer, on the DONOR's Redis: take the amount out
-- of the donor's allocation and record the transfer as debited.
--
-- KEYS[1]  state hash: alloc, debited, credited, seq, epoch, from:<region>
-- KEYS[2]  debits hash: transfer id -> "<amount>:<to>:<seq>:<epoch>:<to epoch>",
--          kept for idempotence; ":refunded" is appended once regions_refund.lua
--          gave the amount back
-- KEYS[3]  pending hash: the same records, until the credit is confirmed
-- ARGV[1]  transfer id
-- ARGV[2]  amount, a positive integer below 2^53
-- ARGV[3]  receiver region
-- ARGV[4]  the receiver's epoch: the credit lands only in that state of it;
--          empty to look the id up only
--
-- Reply (nothing is written unless the reply starts with 1):
--   {1, seq, epoch}               debited now; seq numbers this debit in this region
--   {2, amount, seq, epoch, to, to_epoch, refunded}
--                                 debited before under this id (as recorded then;
--                                 refunded is 1 if given back); nothing changed
--   {0, available}                refused: the allocation is below the amount
--   {-1}                          no state hash: never seeded, or its data was lost
--   {-2}                          not debited before, and ARGV[4] is empty
--
-- Every check runs before the first write, so a refusal or an error changes
-- nothing. The allocation can never go below zero.
local id, to, to_epoch = ARGV[1], ARGV[3], ARGV[4]
local amount = tonumber(ARGV[2])
if not amount or amount < 1 or amount ~= math.floor(amount) then
  return redis.error_reply('ERR regions: amount must be a positive integer')
end
local rec = redis.call('HGET', KEYS[2], id)
if rec then
  local a, t, s, e, te, rest = string.match(rec, '^(%d+):([^:]+):(%d+):([^:]*):([^:]*)(.*)$')
  return {2, tonumber(a), tonumber(s), e, t, te, rest == ':refunded' and 1 or 0}
end
if to_epoch == '' then
  return {-2}
end

local state = redis.call('HMGET', KEYS[1], 'alloc', 'epoch')
if not state[1] then
  return {-1}
end
local alloc = tonumber(state[1])
if alloc < amount then
  return {0, alloc}
end

redis.call('HINCRBY', KEYS[1], 'alloc', '-' .. ARGV[2])
redis.call('HINCRBY', KEYS[1], 'debited', ARGV[2])
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
rec = ARGV[2] .. ':' .. to .. ':' .. seq .. ':' .. (state[2] or '') .. ':' .. to_epoch
redis.call('HSET', KEYS[2], id, rec)
redis.call('HSET', KEYS[3], id, rec)
return {1, seq, state[2] or ''}
