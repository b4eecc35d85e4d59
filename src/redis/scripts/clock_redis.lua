-- tower-admission: production clock. The time is the Redis server's TIME,
-- in microseconds; the argument a test clock would read is ignored. Keys
-- expire exactly when their state becomes equivalent to fresh (rounded up to
-- the millisecond).
-- Effects replication (the default since Redis 5) keeps TIME safe in scripts.
if redis.replicate_commands then redis.replicate_commands() end

local EXPIRY_PAD_MS = 0

local function clock_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
