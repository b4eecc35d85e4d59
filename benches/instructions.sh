#!/usr/bin/env bash
# Instructions per decision (per request for an HTTP stack) under callgrind,
# ours against governor and bare axum (see benches/instructions.rs).
#
#   benches/instructions.sh                        # the decision variants
#   VARIANTS="bare_axum tower_governor quota_layer whole_stack" benches/instructions.sh
#   VARIANTS="bare_axum stack_1 stack_2 stack_3 stack_4 stack_5 whole_stack" benches/instructions.sh
#                                                  # the cost of each layer of the stack
#   VARIANTS="bare_axum passthrough_1 passthrough_6 tower_governor" benches/instructions.sh
#                                                  # what Router::layer and nesting cost
#   SMOKE=1 benches/instructions.sh                # CI: debug build, a few variants,
#                                                  # small counts; checks the table only
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is required: apt-get install -y valgrind" >&2; exit 1; }
if [ "${SMOKE:-0}" = 1 ]; then
  cargo build --all-features --bench instructions >/dev/null 2>&1
  bin=$(ls -t target/debug/deps/instructions-* | grep -v '\.d$' | head -1)
  export WARMUP=2000
  # Enough that the run-to-run spread of quanta's clock calibration (up to
  # about 4M instructions in a debug build) never turns a count negative.
  measured=20000
  variants="${VARIANTS:-governor token_bucket whole_stack}"
else
  cargo build --release --bench instructions >/dev/null 2>&1
  bin=$(ls -t target/release/deps/instructions-* | grep -v '\.d$' | head -1)
  measured=100000
  variants="${VARIANTS:-governor token_bucket sliding_log fixed_window sliding_window free_plan}"
fi
out=$(mktemp)
table=$(mktemp)
trap 'rm -f "$out" "$table"' EXIT
# Every instruction but those of quanta's clock calibration (a OnceCell
# initialiser on first use, and the clock_gettime calls it alone makes here),
# which moves a run by up to 40 per decision and hundreds per request.
count() {
  valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" "$1" "$2" >/dev/null 2>&1
  callgrind_annotate --inclusive=no --threshold=100 --auto=no "$out" \
    | grep -E '^ *[0-9,]+ \(' | grep -v 'PROGRAM TOTALS' | grep -v 'OnceCell<T>::initialize' \
    | grep -v 'clock_gettime' \
    | awk '{gsub(",", "", $1); s += $1} END {print s}'
}
{
  echo "| variant | instructions per decision (per request for a stack) | ratio to the first |"
  echo "|---|---:|---:|"
  base=""
  for v in $variants; do
    full=$(count "$v" "$measured"); none=$(count "$v" 0)
    case "$v" in # the HTTP stacks count one request per 10 decisions
      bare_axum | tower_governor | quota_layer | whole_stack | stack_[1-5] | passthrough_*) per=$(( (full - none) * 10 / measured )) ;;
      *) per=$(( (full - none) / measured )) ;;
    esac
    [ -z "$base" ] && base=$per
    printf '| %s | %d | %s |\n' "$v" "$per" "$(awk -v a="$per" -v b="$base" 'BEGIN {printf "%.2f", a / b}')"
  done
} | tee "$table"
if [ "${SMOKE:-0}" = 1 ]; then
  rows=$(grep -cE '^\| [a-z_]+ \| [0-9]+ \| [0-9]+\.[0-9]{2} \|$' "$table" || true)
  want=$(wc -w <<<"$variants")
  if [ "$rows" != "$want" ]; then
    echo "smoke: $rows well-formed rows of $want" >&2
    exit 1
  fi
  echo "smoke: table well formed ($want variants)" >&2
fi
