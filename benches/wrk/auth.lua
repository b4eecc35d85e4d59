-- The `stack` mode authenticates every request with the API key `bench`.
wrk.headers["Authorization"] = "Bearer bench"

-- Same result line as report.lua (wrk runs one script per run).
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")
