-- Creates a region's state hash if it does not exist; never overwrites one.
--
-- KEYS[1]  state hash
-- ARGV[1]  the allocation to start with (the initial split, or 0 when
--          recovering a region whose data was lost)
-- ARGV[2]  a fresh epoch, naming this life of the region's state
--
-- Reply: 1 created now; 0 it existed and nothing changed.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'alloc', ARGV[1], 'debited', 0, 'credited', 0, 'seq', 0, 'epoch', ARGV[2])
return 1
