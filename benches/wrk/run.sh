#!/usr/bin/env bash
# Over-the-socket HTTP load comparison, side by side in one run:
# bare axum, axum + tower_governor, axum + QuotaLayer, and the full inbound
# stack (examples/bench_server.rs), each loaded by `wrk -t1 -c50 -d10s` on
# 127.0.0.1.
#
#   benches/wrk/run.sh            # from the repository root or anywhere
#
# Every quota admits every request, so this measures the admitted path.
# Two rounds, the second in reverse order; the table shows the median of the
# two runs per mode (with two runs, their mean) and both raw figures.
# Each mode gets a 1 s warm-up before its measured 10 s run. Loopback only.
# About 100 s once the example is built.
#
# Environment: DURATION (default 10s), CONNECTIONS (default 50),
# ROUNDS (default 2), PIN (default 1: the server runs on CPU 0 and wrk on
# CPU 1, through taskset, which keeps the two from migrating onto one core;
# PIN=0 lets the scheduler place both).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
duration="${DURATION:-10s}"
connections="${CONNECTIONS:-50}"
rounds="${ROUNDS:-2}"
modes=(bare governor quota stack)
pin_server=()
pin_wrk=()
pin="${PIN:-1}"
if [ "$pin" = 1 ] && { ! command -v taskset >/dev/null 2>&1 || [ "$(nproc)" -lt 2 ]; }; then
    echo "PIN=1 needs taskset and 2 CPUs; running unpinned" >&2
    pin=0
fi
if [ "$pin" = 1 ]; then
    pin_server=(taskset -c 0)
    pin_wrk=(taskset -c 1)
fi

if ! command -v wrk >/dev/null 2>&1; then
    echo "wrk not found; installing it with apt-get" >&2
    if [ "$(id -u)" -eq 0 ]; then
        apt-get install -y wrk >/dev/null
    else
        sudo apt-get install -y wrk >/dev/null
    fi
fi

echo "building examples/bench_server.rs (release)" >&2
(cd "$root" && cargo build --release --quiet --example bench_server)
server="$root/target/release/examples/bench_server"

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

server_pid=""
stop_server() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
trap stop_server EXIT

wait_for_port() {
    local port="$1"
    for _ in $(seq 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "bench_server exited before listening" >&2
            return 1
        fi
        sleep 0.05
    done
    echo "bench_server did not listen on port $port within 5 s" >&2
    return 1
}

# results[mode] = "rps p50_us p99_us;rps p50_us p99_us;..." over rounds
declare -A results

run_mode() {
    local mode="$1" port script out line
    port="$(free_port)"
    "${pin_server[@]}" "$server" --mode "$mode" --listen "127.0.0.1:$port" 2>/dev/null &
    server_pid=$!
    wait_for_port "$port"
    script="$here/report.lua"
    if [ "$mode" = stack ]; then
        script="$here/auth.lua"
    fi
    "${pin_wrk[@]}" wrk -t1 -c"$connections" -d1s -s "$script" "http://127.0.0.1:$port/" >/dev/null
    out="$("${pin_wrk[@]}" wrk -t1 -c"$connections" -d"$duration" -s "$script" "http://127.0.0.1:$port/")"
    stop_server
    line="$(grep '^WRK_RESULT' <<<"$out")"
    local rps p50 p99 non2xx socket
    rps="$(sed -E 's/.* rps=([0-9]+).*/\1/' <<<"$line")"
    p50="$(sed -E 's/.* p50_us=([0-9]+).*/\1/' <<<"$line")"
    p99="$(sed -E 's/.* p99_us=([0-9]+).*/\1/' <<<"$line")"
    non2xx="$(sed -E 's/.* non2xx=([0-9]+).*/\1/' <<<"$line")"
    socket="$(sed -E 's/.* socket_errors=([0-9]+).*/\1/' <<<"$line")"
    if [ "$non2xx" != 0 ] || [ "$socket" != 0 ]; then
        echo "$mode: $non2xx non-2xx responses and $socket socket errors; every request must be admitted" >&2
        exit 1
    fi
    echo "  $mode: $rps req/s, p50 ${p50} us, p99 ${p99} us" >&2
    results[$mode]="${results[$mode]:-}${rps} ${p50} ${p99};"
}

commit="$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git -C "$root" status --porcelain -- src Cargo.toml 2>/dev/null)" ]; then
    commit="$commit + uncommitted changes in src/ or Cargo.toml"
fi
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for round in $(seq "$rounds"); do
    echo "round $round" >&2
    if [ $((round % 2)) -eq 1 ]; then
        order=("${modes[@]}")
    else
        order=()
        for ((i = ${#modes[@]} - 1; i >= 0; i--)); do order+=("${modes[$i]}"); done
    fi
    for mode in "${order[@]}"; do
        run_mode "$mode"
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# median of a list of numbers (mean of the two middle ones when even)
median() {
    tr ' ' '\n' | sort -n | awk '{ v[NR] = $1 } END {
        if (NR % 2) printf "%.0f", v[(NR + 1) / 2];
        else printf "%.0f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
column_of() { # mode, field (1 rps, 2 p50, 3 p99)
    tr ';' '\n' <<<"${results[$1]}" | awk -v f="$2" 'NF { print $f }' | paste -sd' '
}

declare -A med_rps
for mode in "${modes[@]}"; do
    med_rps[$mode]="$(column_of "$mode" 1 | median)"
done

echo
echo "wrk -t1 -c$connections -d$duration, $rounds rounds (order alternated), median per mode; server: 1 tokio worker; source: $commit; pinned: $pin"
echo
echo "| mode | req/s (median) | req/s per run | p50 latency (median) | p99 latency (median) | req/s vs bare |"
echo "|---|---:|---|---:|---:|---:|"
for mode in "${modes[@]}"; do
    p50="$(column_of "$mode" 2 | median)"
    p99="$(column_of "$mode" 3 | median)"
    runs="$(column_of "$mode" 1 | sed 's/ /, /g')"
    ratio="$(awk -v a="${med_rps[$mode]}" -v b="${med_rps[bare]}" 'BEGIN { printf "%.3f", a / b }')"
    printf '| %s | %s | %s | %s µs | %s µs | %s |\n' \
        "$mode" "${med_rps[$mode]}" "$runs" "$p50" "$p99" "$ratio"
done
echo
printf 'quota / governor req/s: %s\n' \
    "$(awk -v a="${med_rps[quota]}" -v b="${med_rps[governor]}" 'BEGIN { printf "%.3f", a / b }')"
