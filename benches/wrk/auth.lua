-- The request of every mode: the whole inbound stack
-- (benches/common/inbound.rs) needs it, authenticated with the API key
-- `bench` and carrying the query parameters the stack validates; the other
-- modes get the same bytes and ignore them, so that the ratios count only
-- the layers.
wrk.headers["Authorization"] = "Bearer bench"
wrk.path = "/?from=2026-11-01T00:00:00Z&to=2026-11-02T00:00:00Z&page_size=20"

-- Same result line as report.lua (wrk runs one script per run).
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")
