#!/usr/bin/env bash
# Runs one stage of `make test` and notes how long it took:
#   scripts/stage.sh reset                  starts a new list of stage times
#   scripts/stage.sh run NAME CCACHE_DIR|- COMMAND [ARG ...]
#                                          runs COMMAND; notes NAME, seconds, its exit
#                                          status and, where CCACHE_DIR is given, the share
#                                          of compilations served by that compiler cache
#   scripts/stage.sh summary                prints the list as a table
# The list is build/stage-times.tsv.
set -uo pipefail
cd "$(dirname "$0")/.."
times=build/stage-times.tsv

case "${1:-}" in
  reset)
    mkdir -p build
    : > "$times"
    ;;
  run)
    name=$2 cache=$3
    shift 3
    if [ "$cache" != - ] && command -v ccache >/dev/null; then
      CCACHE_DIR=$cache ccache --zero-stats >/dev/null 2>&1 || true
    fi
    start=$(date +%s)
    "$@"
    status=$?
    seconds=$(( $(date +%s) - start ))
    cached=-
    if [ "$cache" != - ] && command -v ccache >/dev/null && [ -d "$cache" ]; then
      # ccache --print-stats: one "name<TAB>value" line a counter.
      cached=$(CCACHE_DIR=$cache ccache --print-stats 2>/dev/null | awk -F'\t' '
        $1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { hit += $2 }
        $1 == "cache_miss" { miss += $2 }
        END { if (hit + miss > 0) printf "%d of %d", hit, hit + miss; else print "none" }')
    fi
    mkdir -p build
    printf '%s\t%s\t%s\t%s\n' "$name" "$seconds" "$status" "$cached" >> "$times"
    exit $status
    ;;
  summary)
    [ -s "$times" ] || exit 0
    awk -F'\t' '
      BEGIN { printf "\n%-18s %9s  %-7s %s\n", "stage", "time", "result", "compiled from the cache" }
      {
        total += $2
        printf "%-18s %4d:%02d  %-7s %s\n", $1, $2 / 60, $2 % 60, ($3 == 0 ? "ok" : "FAILED"), $4
      }
      END { printf "%-18s %4d:%02d\n", "all", total / 60, total % 60 }' "$times"
    ;;
  *)
    echo "usage: scripts/stage.sh reset | run NAME CCACHE_DIR|- COMMAND... | summary" >&2
    exit 2
    ;;
esac
