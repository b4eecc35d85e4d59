-- Prints one machine-readable line after a wrk run, read by run.sh:
-- WRK_RESULT requests=N duration_us=N rps=N p50_us=N p99_us=N non2xx=N socket_errors=N
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT requests=%d duration_us=%d rps=%.0f p50_us=%d p99_us=%d non2xx=%d socket_errors=%d\n",
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99), e.status,
    e.connect + e.read + e.write + e.timeout))
end
