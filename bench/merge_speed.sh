#!/usr/bin/env bash
# `dart-ngram merge` of two binaries side by side (issue #22, "merge at disk speed"): each
# round runs every configuration once, in turn, on the same shard models, and checks that
# every output is byte for byte the first one's. Prints one TSV line per run: wall time, MB/s
# of output, user and system CPU, peak RSS (/usr/bin/time -v).
#
#   bench/merge_speed.sh OLD_BIN NEW_BIN WORKDIR ROUNDS SHARD.ngram...
#
# Both binaries run with `--threads T` for each T in THREADS (default "1 2"); OLD_THREADS=""
# runs OLD_BIN once without the flag (binaries before the fourth round had none). Set NICE
# (default 15).
set -euo pipefail
OLD=${1:?usage: merge_speed.sh OLD_BIN NEW_BIN WORKDIR ROUNDS SHARD.ngram...}
NEW=${2:?}
WORK=${3:?}
ROUNDS=${4:?}
shift 4
NICE=${NICE:-15}
THREADS=${THREADS:-1 2}
OLD_THREADS=${OLD_THREADS-$THREADS}
configs=()
if [ -z "$OLD_THREADS" ]; then configs+=(old); fi
for t in $OLD_THREADS; do configs+=("old-t$t"); done
for t in $THREADS; do configs+=("new-t$t"); done
mkdir -p "$WORK"
printf 'round\tconfig\twall_s\tout_MB_per_s\tuser_s\tsys_s\tpeak_rss_MB\n'
for r in $(seq 1 "$ROUNDS"); do
    for cfg in "${configs[@]}"; do
        case $cfg in
            old) cmd=("$OLD" merge "$@" -o "$WORK/out.ngram") ;;
            old-t*) cmd=("$OLD" merge "$@" -o "$WORK/out.ngram" --threads "${cfg#old-t}") ;;
            new-t*) cmd=("$NEW" merge "$@" -o "$WORK/out.ngram" --threads "${cfg#new-t}") ;;
        esac
        rm -f "$WORK/out.ngram"
        /usr/bin/time -v -o "$WORK/time.txt" nice -n "$NICE" "${cmd[@]}" 2>/dev/null
        field() { grep -F "$1" "$WORK/time.txt" | sed 's/.*: //'; }
        wall=$(field 'Elapsed (wall clock)' | awk -F: '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; print s }')
        bytes=$(stat -c %s "$WORK/out.ngram")
        if [ -f "$WORK/first.ngram" ]; then
            cmp -s "$WORK/out.ngram" "$WORK/first.ngram" || { echo "$cfg: output differs" >&2; exit 1; }
        else
            mv "$WORK/out.ngram" "$WORK/first.ngram"
        fi
        printf '%s\t%s\t%s\t%.1f\t%s\t%s\t%d\n' "$r" "$cfg" "$wall" \
            "$(echo "$bytes / $wall / 1000000" | bc -l)" "$(field 'User time')" \
            "$(field 'System time')" "$(($(field 'Maximum resident') / 1024))"
    done
done
rm -f "$WORK/out.ngram" "$WORK/first.ngram" "$WORK/time.txt"
