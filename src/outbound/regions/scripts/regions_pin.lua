-- On a region that holds state while another region is missing: from now
-- on, credits from that region land here only from its state with the
-- given epoch, so a debit made by a lost state of it (whose credit may
-- still be on the way) never lands after it was re-seeded.
--
-- KEYS[1]  state hash
-- ARGV[1]  the other region
-- ARGV[2]  the epoch its credits must carry
-- ARGV[3]  'untouched': pin only while this region has no debit and no
--          credit (before the other is seeded at its initial share);
--          'existing': only replace a pin already set; 'always'
--
-- Reply: 1 pinned; 0 nothing changed (touched, or no pin to replace);
--        -1 no state hash.
local state = redis.call('HMGET', KEYS[1], 'debited', 'credited')
if not state[1] then
  return -1
end
local field = 'pin:' .. ARGV[1]
if ARGV[3] == 'untouched' and (tonumber(state[1]) > 0 or tonumber(state[2] or '0') > 0) then
  return 0
end
if ARGV[3] == 'existing' and redis.call('HEXISTS', KEYS[1], field) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], field, ARGV[2])
return 1
