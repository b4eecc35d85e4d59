#!/usr/bin/env bash
# Instructions per decision under callgrind, ours against governor (see benches/instructions.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is required: apt-get install -y valgrind" >&2; exit 1; }
cargo build --release --bench instructions >/dev/null 2>&1
bin=$(ls -t target/release/deps/instructions-* | grep -v '\.d$' | head -1)
measured=100000
count() { valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$1" "$2" 2>&1 | awk '/Collected/ {print $4}'; }
echo "| variant | instructions per decision | ratio to governor |"
echo "|---|---:|---:|"
base=""
for v in governor token_bucket sliding_log fixed_window sliding_window free_plan; do
  full=$(count "$v" "$measured"); none=$(count "$v" 0)
  per=$(( (full - none) / measured ))
  [ -z "$base" ] && base=$per
  printf '| %s | %d | %s |\n' "$v" "$per" "$(awk -v a="$per" -v b="$base" 'BEGIN {printf "%.2f", a / b}')"
done
