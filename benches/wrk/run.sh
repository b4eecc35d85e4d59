#!/usr/bin/env bash
# Over-the-socket HTTP load comparison, side by side in one run:
# bare axum, axum + tower_governor, axum + QuotaLayer, the whole inbound
# stack in memory and the same stack on Redis (examples/bench_server.rs),
# each loaded by `wrk -t1 -c50 -d10s` on 127.0.0.1.
#
#   benches/wrk/run.sh            # from the repository root or anywhere
#   SMOKE=1 benches/wrk/run.sh    # CI: 1 round of 2 s per mode, checks the table
#
# The stack-redis mode runs on a redis-server this script starts on a free
# port (and stops); it is left out, with a note, when redis-server or
# redis-benchmark is missing. After the rounds, redis-benchmark runs on that
# server the two EVALSHA commands the stack sends per request (one per
# quota), for the Redis ceiling.
#
# Every quota admits every request, so this measures the admitted path.
# Five rounds, every other one in reverse order; the table shows the median
# of the runs per mode and every raw figure, and the server's CPU time per
# request in user space and in the kernel (from /proc), which tells the
# layers' own work from what the kernel spends on the same traffic. Each
# mode gets a 1 s warm-up before its measured 10 s run. Loopback only.
# About 6 minutes once the example is built.
#
# Environment: DURATION (default 10s), CONNECTIONS (default 50),
# ROUNDS (default 5), MODES (default "bare governor quota stack
# stack-redis"; bare is always run, since the ratios are to it; stack-1 to
# stack-5, the stack cut after its first N layers, give each layer's cost;
# stack-no-fields, the stack without RateLimit fields on admitted responses,
# gives theirs), REDIS_N (requests per redis-benchmark run, default
# 200000), PIN (default 1: the server runs on CPU 0 and wrk on CPU 1,
# through taskset, which keeps the two from migrating onto one core; PIN=0
# lets the scheduler place both).
# SMOKE=1 sets ROUNDS=1, DURATION=2s, REDIS_N=20000 unless they are given,
# runs the debug build, and checks that the table is well formed; it never
# checks a figure. About 30 s once the example is built.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
smoke="${SMOKE:-0}"
if [ "$smoke" = 1 ]; then
    duration="${DURATION:-2s}"
    rounds="${ROUNDS:-1}"
    redis_n="${REDIS_N:-20000}"
else
    duration="${DURATION:-10s}"
    rounds="${ROUNDS:-5}"
    redis_n="${REDIS_N:-200000}"
fi
connections="${CONNECTIONS:-50}"
read -r -a modes <<<"${MODES:-bare governor quota stack stack-redis}"
if [ "${modes[0]}" != bare ]; then
    modes=(bare "${modes[@]/bare/}")
    read -r -a modes <<<"${modes[*]}"
fi
use_redis=0
for mode in "${modes[@]}"; do
    [ "$mode" = stack-redis ] && use_redis=1
done
if [ "$use_redis" = 1 ] && { ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-benchmark >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; }; then
    echo "redis-server, redis-cli or redis-benchmark not found: leaving out stack-redis" >&2
    use_redis=0
    read -r -a modes <<<"${modes[*]/stack-redis/}"
fi
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

if [ "$smoke" = 1 ]; then
    # The debug build `cargo test --all-features` already made: the smoke
    # checks the script, not the figures.
    echo "building examples/bench_server.rs (debug, all features)" >&2
    (cd "$root" && cargo build --quiet --all-features --example bench_server)
    server="$root/target/debug/examples/bench_server"
else
    echo "building examples/bench_server.rs (release, feature redis)" >&2
    (cd "$root" && cargo build --release --quiet --features redis --example bench_server)
    server="$root/target/release/examples/bench_server"
fi

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
redis_pid=""
redis_dir=""
stop_redis() {
    if [ -n "$redis_pid" ]; then
        kill "$redis_pid" 2>/dev/null || true
        wait "$redis_pid" 2>/dev/null || true
        redis_pid=""
    fi
    if [ -n "$redis_dir" ]; then
        rm -rf "$redis_dir"
        redis_dir=""
    fi
}
trap 'stop_server; stop_redis' EXIT

# A redis-server of our own on a free port, without persistence, on the
# wrk CPU (Redis and wrk share it; the server under test keeps its own).
redis_port=""
if [ "$use_redis" = 1 ]; then
    redis_port="$(free_port)"
    redis_dir="$(mktemp -d)"
    "${pin_wrk[@]}" redis-server --port "$redis_port" --bind 127.0.0.1 --save '' \
        --appendonly no --dir "$redis_dir" >"$redis_dir/log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 100); do
        redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
        sleep 0.05
    done
    if ! redis-cli -p "$redis_port" ping >/dev/null 2>&1; then
        echo "redis-server did not start on port $redis_port:" >&2
        cat "$redis_dir/log" >&2
        exit 1
    fi
    echo "redis-server $(redis-server --version | sed -E 's/.*v=([^ ]+).*/\1/') on port $redis_port" >&2
fi

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

# results[mode] = "rps p50_us p99_us user_ns kernel_ns;..." over rounds: the
# last two are the server's CPU time per request during the measured run,
# in user space and in the kernel (its utime and stime, which the kernel
# counts in ticks of 1/CLK_TCK s: at 100 ticks and 3 s of 400,000 requests,
# 25 ns a tick per request).
declare -A results
ticks_per_s="$(getconf CLK_TCK)"
# The server's user and kernel CPU time so far, in ticks: fields 14 and 15
# of /proc/PID/stat (its command name, field 2, holds no space here).
cpu_ticks() { awk '{ print $14, $15 }' "/proc/$1/stat"; }
# Ticks spent over a run of N requests, as ns per request.
ns_per_request() { # ticks, requests
    awk -v t="$1" -v hz="$ticks_per_s" -v n="$2" 'BEGIN { printf "%.0f", t * 1e9 / hz / n }'
}

run_mode() {
    local mode="$1" port script out line
    port="$(free_port)"
    local redis_args=()
    if [ "$mode" = stack-redis ]; then
        redis_args=(--redis "redis://127.0.0.1:$redis_port/")
    fi
    "${pin_server[@]}" "$server" --mode "$mode" --listen "127.0.0.1:$port" "${redis_args[@]}" 2>/dev/null &
    server_pid=$!
    wait_for_port "$port"
    # Every mode gets the same request, the one the stack needs, so that the
    # ratios count only the layers.
    script="$here/auth.lua"
    "${pin_wrk[@]}" wrk -t1 -c"$connections" -d1s -s "$script" "http://127.0.0.1:$port/" >/dev/null
    local user0 kernel0 user1 kernel1
    read -r user0 kernel0 < <(cpu_ticks "$server_pid")
    out="$("${pin_wrk[@]}" wrk -t1 -c"$connections" -d"$duration" -s "$script" "http://127.0.0.1:$port/")"
    read -r user1 kernel1 < <(cpu_ticks "$server_pid")
    stop_server
    line="$(grep '^WRK_RESULT' <<<"$out")"
    local rps p50 p99 non2xx socket requests user_ns kernel_ns
    rps="$(sed -E 's/.* rps=([0-9]+).*/\1/' <<<"$line")"
    requests="$(sed -E 's/.* requests=([0-9]+).*/\1/' <<<"$line")"
    # The server answered at least wrk's count (wrk leaves out the requests
    # still in flight when it stops), so these read a little high, alike
    # for every mode.
    user_ns="$(ns_per_request $((user1 - user0)) "$requests")"
    kernel_ns="$(ns_per_request $((kernel1 - kernel0)) "$requests")"
    p50="$(sed -E 's/.* p50_us=([0-9]+).*/\1/' <<<"$line")"
    p99="$(sed -E 's/.* p99_us=([0-9]+).*/\1/' <<<"$line")"
    non2xx="$(sed -E 's/.* non2xx=([0-9]+).*/\1/' <<<"$line")"
    socket="$(sed -E 's/.* socket_errors=([0-9]+).*/\1/' <<<"$line")"
    if [ "$non2xx" != 0 ] || [ "$socket" != 0 ]; then
        echo "$mode: $non2xx non-2xx responses and $socket socket errors; every request must be admitted" >&2
        exit 1
    fi
    echo "  $mode: $rps req/s, p50 ${p50} us, p99 ${p99} us; server CPU per request ${user_ns} ns user, ${kernel_ns} ns kernel" >&2
    results[$mode]="${results[$mode]:-}${rps} ${p50} ${p99} ${user_ns} ${kernel_ns};"
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
column_of() { # mode, field (1 rps, 2 p50, 3 p99, 4 user ns, 5 kernel ns)
    tr ';' '\n' <<<"${results[$1]}" | awk -v f="$2" 'NF { print $f }' | paste -sd' '
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
# The median over rounds of mode a's req/s / mode b's in the same round: a
# drift of the machine between rounds falls on both sides of each ratio.
round_ratio() { # mode a, mode b
    paste -d' ' <(column_of "$1" 1 | tr ' ' '\n') <(column_of "$2" 1 | tr ' ' '\n') |
        awk '{ printf "%.6f\n", $1 / $2 }' | sort -n | awk '{ v[NR] = $1 } END {
            if (NR % 2) printf "%.3f", v[(NR + 1) / 2];
            else printf "%.3f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

declare -A med_rps
for mode in "${modes[@]}"; do
    med_rps[$mode]="$(column_of "$mode" 1 | median)"
done

# The Redis ceiling: redis-benchmark running the stack's two EVALSHA
# commands (one per quota, as stack-redis sends them for every request) on
# the same server, 50 connections, plain and with 16 pipelined per
# connection (the store's multiplexed connection pipelines too). A request
# needs one of each, so the ceiling in requests/s is 1 / (1/a + 1/b).
redis_bench() { # pipeline, command words...
    local pipeline="$1"
    shift
    "${pin_wrk[@]}" redis-benchmark -h 127.0.0.1 -p "$redis_port" -n "$redis_n" -c 50 \
        -P "$pipeline" --csv "$@" | awk -F'","' '/^"EVALSHA/ { gsub(/"/, "", $2); printf "%.0f", $2 }'
}
declare -A ceiling
if [ "$use_redis" = 1 ]; then
    echo "redis-benchmark: the stack's EVALSHA commands, $redis_n each" >&2
    mapfile -t commands < <("$server" --redis-commands)
    # The stack-redis runs loaded the script; each command must succeed.
    for command in "${commands[@]}"; do
        read -r -a words <<<"$command"
        reply="$(redis-cli -p "$redis_port" "${words[@]}" 2>&1)"
        if ! head -1 <<<"$reply" | grep -Eq '^-?[0-9]+$'; then
            echo "redis-benchmark command fails: $reply" >&2
            exit 1
        fi
    done
    for pipeline in 1 16; do
        rates=()
        for command in "${commands[@]}"; do
            read -r -a words <<<"$command"
            rates+=("$(redis_bench "$pipeline" "${words[@]}")")
        done
        ceiling[$pipeline]="${rates[*]}"
    done
fi

table="$(
    echo "wrk -t1 -c$connections -d$duration, $rounds rounds (order alternated), median per mode; server: 1 tokio worker; source: $commit; pinned: $pin"
    echo
    echo "| mode | req/s (median) | req/s per run | p50 latency (median) | p99 latency (median) | req/s vs bare | per-round ratio to bare (median) | server CPU per request, user (median) | server CPU per request, kernel (median) |"
    echo "|---|---:|---|---:|---:|---:|---:|---:|---:|"
    for mode in "${modes[@]}"; do
        p50="$(column_of "$mode" 2 | median)"
        p99="$(column_of "$mode" 3 | median)"
        runs="$(column_of "$mode" 1 | sed 's/ /, /g')"
        printf '| %s | %s | %s | %s µs | %s µs | %s | %s | %s ns | %s ns |\n' \
            "$mode" "${med_rps[$mode]}" "$runs" "$p50" "$p99" "$(ratio "${med_rps[$mode]}" "${med_rps[bare]}")" \
            "$(round_ratio "$mode" bare)" "$(column_of "$mode" 4 | median)" "$(column_of "$mode" 5 | median)"
    done
    echo
    if [ -n "${med_rps[governor]:-}" ] && [ -n "${med_rps[quota]:-}" ]; then
        printf 'quota / governor req/s: %s (per-round median %s)\n' \
            "$(ratio "${med_rps[quota]}" "${med_rps[governor]}")" "$(round_ratio quota governor)"
    fi
    if [ -n "${med_rps[stack]:-}" ]; then
        printf 'stack / bare req/s: %s (per-round median %s)\n' \
            "$(ratio "${med_rps[stack]}" "${med_rps[bare]}")" "$(round_ratio stack bare)"
    fi
    if [ "$use_redis" = 1 ]; then
        echo
        echo "Redis ceiling: redis-benchmark -c 50 -n $redis_n on the same redis-server, the stack's EVALSHA per quota"
        echo
        echo "| pipeline | per-user EVALSHA/s | aggregate EVALSHA/s | requests/s (one of each) | stack-redis / ceiling |"
        echo "|---|---:|---:|---:|---:|"
        for pipeline in 1 16; do
            read -r a b <<<"${ceiling[$pipeline]}"
            both="$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.0f", 1 / (1 / a + 1 / b) }')"
            printf '| -P %s | %s | %s | %s | %s |\n' "$pipeline" "$a" "$b" "$both" "$(ratio "${med_rps[stack-redis]}" "$both")"
        done
    fi
)"
echo
echo "$table"

if [ "$smoke" = 1 ]; then
    # Well formed: one row per mode, each with a positive req/s and a ratio;
    # with Redis, two ceiling rows of positive figures. No figure is judged.
    number='[0-9]+(\.[0-9]+)?'
    for mode in "${modes[@]}"; do
        if ! grep -Eq "^\| $mode \| [1-9][0-9]* \| [0-9, ]+ \| [0-9]+ µs \| [0-9]+ µs \| $number \| $number \| [0-9]+ ns \| [0-9]+ ns \|$" <<<"$table"; then
            echo "smoke: no well-formed row for mode $mode" >&2
            exit 1
        fi
    done
    if [ "$use_redis" = 1 ] && [ "$(grep -Ec "^\| -P (1|16) \| [1-9][0-9]* \| [1-9][0-9]* \| [1-9][0-9]* \| $number \|$" <<<"$table")" != 2 ]; then
        echo "smoke: the Redis ceiling table is not well formed" >&2
        exit 1
    fi
    echo "smoke: table well formed (${#modes[@]} modes$([ "$use_redis" = 1 ] && echo ", Redis ceiling"))" >&2
fi
