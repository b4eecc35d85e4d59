#!/usr/bin/env bash
# Instructions per decision under callgrind, ours against governor (see benches/instructions.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is required: apt-get install -y valgrind" >&2; exit 1; }
cargo build --release --bench instructions >/dev/null 2>&1
bin=$(ls -t target/release/deps/instructions-* | grep -v '\.d$' | head -1)
measured=100000
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# Every instruction but those of quanta's clock calibration (a OnceCell
# initialiser on first use), which alone moves a run by up to 40 per decision.
count() {
  valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" "$1" "$2" >/dev/null 2>&1
  callgrind_annotate --inclusive=no --threshold=100 --auto=no "$out" \
    | grep -E '^ *[0-9,]+ \(' | grep -v 'PROGRAM TOTALS' | grep -v 'OnceCell<T>::initialize' \
    | awk '{gsub(",", "", $1); s += $1} END {print s}'
}
echo "| variant | instructions per decision (per request for a stack) | ratio to the first |"
echo "|---|---:|---:|"
base=""
for v in ${VARIANTS:-governor token_bucket sliding_log fixed_window sliding_window free_plan}; do
  full=$(count "$v" "$measured"); none=$(count "$v" 0)
  case "$v" in # the HTTP stacks count one request per 100 decisions' worth
    bare_axum | tower_governor | quota_layer | whole_stack) per=$(( (full - none) * 100 / measured )) ;;
    *) per=$(( (full - none) / measured )) ;;
  esac
  [ -z "$base" ] && base=$per
  printf '| %s | %d | %s |\n' "$v" "$per" "$(awk -v a="$per" -v b="$base" 'BEGIN {printf "%.2f", a / b}')"
done
