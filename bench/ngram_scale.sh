#!/usr/bin/env bash
# The n-gram engine at the reference's scale (issue #22): synthetic corpus -> shards built
# within a memory budget -> merge -> info -> bench (-> daemon RSS), as deploy/k8s's Indexed
# build Job and merge Job would run it, with wall time, peak RSS (/usr/bin/time -v) and spill
# disk use per stage. Figures go to docs/benchmarks.md ("At the reference's scale").
#
#   bench/ngram_scale.sh WORKDIR [TOKENS] [SHARDS] [STAGES...]
#
# STAGES (default: all): synth build merge info bench daemon clean. WORKDIR must have room:
# about 4.6 bytes per corpus token, plus ~5 bytes per n-gram for the shard models and as
# much for the merged model. Set DART_NGRAM (default: dart-ngram on PATH), NICE (default 10),
# MEMORY (default 4G), THREADS (default 1).
set -euo pipefail
WORK=${1:?usage: ngram_scale.sh WORKDIR [TOKENS] [SHARDS] [STAGES...]}
TOKENS=${2:-3.6e9}
SHARDS=${3:-10}
shift $(($# < 3 ? $# : 3))
STAGES=${*:-synth build merge info bench daemon clean}
BIN=${DART_NGRAM:-dart-ngram}
NICE=${NICE:-10}
MEMORY=${MEMORY:-4G}
THREADS=${THREADS:-1}
VOCAB=50000
mkdir -p "$WORK"/corpus "$WORK"/shards "$WORK"/spill "$WORK"/log
LOG="$WORK/log/stages.tsv"
[ -f "$LOG" ] || printf 'stage\twall_s\tpeak_rss_kb\textra\n' >"$LOG"

# Runs one timed step: its /usr/bin/time -v report goes to log/NAME.time.
timed() {
    local name=$1
    shift
    /usr/bin/time -v -o "$WORK/log/$name.time" nice -n "$NICE" "$@"
}
wall() { awk -F': ' '/Elapsed/ {n=split($2,t,":"); s=0; for(i=1;i<=n;i++) s=s*60+t[i]; print s}' "$1"; }
rss() { awk -F': ' '/Maximum resident/ {print $2}' "$1"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$(wall "$WORK/log/$1.time")" "$(rss "$WORK/log/$1.time")" "${2:-}" >>"$LOG"; }

for stage in $STAGES; do
    case $stage in
    synth)
        timed synth "$BIN" synth --output "$WORK/corpus" --tokens "$TOKENS" --shards "$SHARDS" \
            --vocab-size $VOCAB --threads "$THREADS" | tee "$WORK/log/synth.out"
        record synth "$(du -sb "$WORK/corpus" | cut -f1) corpus bytes"
        ;;
    build)
        for f in "$WORK"/corpus/shard-*.jsonl; do
            s=$(basename "$f" .jsonl)
            # Peak spill disk use: sampled while the build runs.
            (peak=0; while sleep 2; do u=$(du -sb "$WORK/spill" 2>/dev/null | cut -f1); \
                [ "${u:-0}" -gt "$peak" ] && peak=$u && echo "$peak" >"$WORK/log/build-$s.spill"; done) &
            watcher=$!
            timed "build-$s" "$BIN" build --input "$f" --output "$WORK/shards/$s.ngram" \
                --eos-id 0 --vocab-size $VOCAB --memory "$MEMORY" --threads "$THREADS" \
                --tmp-dir "$WORK/spill" --quiet --json >"$WORK/log/build-$s.json"
            kill "$watcher"
            record "build-$s" "tokens/s $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(round(r["tokens_per_second"]), "spills", r["spilled_runs"], "ngrams", sum(r["ngrams_per_order"]))' "$WORK/log/build-$s.json") peak spill bytes $(cat "$WORK/log/build-$s.spill" 2>/dev/null || echo 0)"
        done
        ;;
    merge)
        timed merge "$BIN" merge "$WORK"/shards/*.ngram --output "$WORK/merged.ngram" 2>&1 | tee "$WORK/log/merge.out"
        record merge "$(stat -c %s "$WORK/merged.ngram") bytes"
        ;;
    info)
        "$BIN" info --sections "$WORK/merged.ngram" | tee "$WORK/log/info.out"
        ;;
    bench)
        timed bench "$BIN" bench "$WORK/merged.ngram" --cold --cold-mapping --prefetch --random-access --json | tee "$WORK/log/bench.json"
        record bench
        ;;
    daemon)
        timed daemon python -m dart_client.apps.bench.daemon_bench --model "$WORK/merged.ngram" \
            --rss-after 10000 --skip-checksums --threads 1 --clients 1 --repeat 1 \
            --requests 1000 | tee "$WORK/log/daemon.out"
        record daemon
        ;;
    clean)
        rm -rf "$WORK/corpus" "$WORK/shards" "$WORK/spill" "$WORK/merged.ngram"
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
done
cat "$LOG"
