-- tower-admission: TEST-ONLY clock. The time is ARGV[CLOCK_ARG], injected by
-- a caller built with a test clock; the Rust side defines CLOCK_ARG (the
-- argument each script keeps for it) before this file. A production script
-- never loads this file: it is a different script (a different SHA) built
-- with clock_redis.lua.
--
-- An injected clock stands still while Redis's expiry clock runs, so a key
-- due to expire 1 ms after the injected time would vanish during the test.
-- Test keys therefore live one hour longer than their state matters.
-- Expiry never changes a decision (each algorithm cleans up by itself), and
-- a settle reads the quota key's expiry from its value, in this clock's
-- time; the production expiry is checked against TIME by the TTL test.
local EXPIRY_PAD_MS = 3600000

local function clock_now()
  return tonumber(ARGV[CLOCK_ARG])
end
