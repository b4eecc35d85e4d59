-- Step 2 of a regional transfer, on the RECEIVER's Redis: add the amount to
-- the receiver's allocation, once. Sent only after the donor confirmed the
-- debit (step 1), so the money is never in two places.
--
-- KEYS[1]  state hash: alloc, debited, credited, seq, epoch, from:<region>
-- KEYS[2]  credits hash: "<from>:<transfer id>" -> "<amount>:<seq>:<donor epoch>",
--          kept for idempotence
-- ARGV[1]  donor region
-- ARGV[2]  transfer id
-- ARGV[3]  amount, as recorded by the donor's debit
-- ARGV[4]  the debit's seq in the donor region
-- ARGV[5]  the donor's epoch (changes only when the donor is re-seeded)
-- ARGV[6]  the receiver's epoch recorded by the debit
--
-- Reply (nothing is written unless the reply starts with 1):
--   {1, alloc}    credited now; alloc is the new allocation
--   {2, amount}   credited before from this donor state and id; nothing changed
--   {3, amount}   credited before under this id from an EARLIER state of the
--                 donor (it lost its data, which held the debit record, and a
--                 retry debited the id again): this debit is never credited
--   {-1}          no state hash: never seeded, or its data was lost. The
--                 credit is NOT applied to a missing state: creating the
--                 allocation from nothing would hide the loss.
--   {-2, epoch}   the state was re-created (recover_lost) after the debit:
--                 its epoch is not ARGV[6]. Never credited: the lost state may
--                 have received the amount already and passed it on.
--   {-3}          the donor was re-seeded (initialize) after losing the state
--                 that made this debit: `pin:<donor>` names the only donor
--                 epoch credited here. Never credited: the re-seeded share
--                 holds the amount again.
--
-- `from:<donor>` keeps "<epoch>:<highest seq credited from that donor>", so
-- a reader can tell whether a set of per-region reads is a consistent cut.
local state = redis.call('HMGET', KEYS[1], 'alloc', 'epoch')
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

local field = ARGV[1] .. ':' .. ARGV[2]
local rec = redis.call('HGET', KEYS[2], field)
if rec then
  local a, e = string.match(rec, '^(%d+):%d+:?(.*)$')
  if e == ARGV[5] then
    return {2, tonumber(a)}
  end
  return {3, tonumber(a)}
end

local alloc = redis.call('HINCRBY', KEYS[1], 'alloc', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'credited', ARGV[3])

local epoch = ARGV[5]
note_sent_seq(KEYS[1], ARGV[1], ARGV[4], epoch)

redis.call('HSET', KEYS[2], field, ARGV[3] .. ':' .. ARGV[4] .. ':' .. epoch)
return {1, alloc}
