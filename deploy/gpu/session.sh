#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one call, for a machine lent for minutes: each step runs under
# its own time limit and appends to one log, so a step that fails or runs long costs only itself.
# Results (JSON, the logs) are packed into $OUT/results.tar after every step.
#   bash deploy/gpu/unpack.sh ... && bash deploy/gpu/session.sh [STEP ...]
# STEP: env static precision bench shapes shapes-real triton attention attention-batched real profile batched admission prune-host eagle3 generate, or next (docs/gpu.md's waiting list)
# (default: all, in that order).
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
R=$OUT/r
mkdir -p "$R"
NG=/tmp/gpu/embedded.ngram
SG=/tmp/gpu/prompts/sharegpt.jsonl
LOG=$OUT/log.txt
# Each call brings the checkout anew; where it travelled without the heads' weights
# (docs/gpu.md), the parts that unpack.sh left in /tmp/gpu hold them.
[ -d /tmp/gpu/heads ] && cp -r /tmp/gpu/heads/. dart_client/heads/
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$R/$name.log" >> "$LOG"
  echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  tar -C "$OUT" -cf "$OUT/results.tar" r
}
run() {
  case $1 in
    env) step env 60 bash -c 'nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
    static) step static 150 env DART_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
        tests/test_static.py tests/test_head.py tests/test_attention.py tests/test_gpu_kernels.py \
        tests/test_batch.py tests/test_logprobs.py ;;
    precision) step precision 60 python3 docs/bench/gpu-h200-2026-11-28c/attention_error.py ;;
    bench) step bench 280 python3 -m dart_client.apps.bench.cli --device cuda --ngram "$NG" \
        --workloads humaneval "$SG" --max-prompts 8 --max-new-tokens 128 --methods ar dart \
        --no-progress --output-dir "$R/bench" ;;
    shapes) step shapes-8b 100 python3 -m dart_client.apps.bench.gpu_shapes --shape llama3-8b \
        --device cuda --ngram "$NG" --batch 8 --json "$R/shapes-llama3-8b.json"
      step shapes-smollm2 60 python3 -m dart_client.apps.bench.gpu_shapes --shape smollm2 \
        --device cuda --ngram "$NG" --json "$R/shapes-smollm2.json" ;;
    shapes-real) step shapes-embedded 90 python3 -m dart_client.apps.bench.gpu_shapes \
        --base embedded --device cuda --ngram "$NG" --batch 8 --json "$R/shapes-embedded.json" ;;
    triton) step triton-off 90 env DART_GPU_KERNELS=torch DART_GPU_ATTENTION=torch \
        python3 -m dart_client.apps.bench.gpu_shapes --base embedded --device cuda \
        --json "$R/shapes-embedded-plain.json"
      step triton-on 120 python3 -m dart_client.apps.bench.gpu_shapes --base embedded \
        --device cuda --json "$R/shapes-embedded-triton.json" ;;
    attention) step attention-sdpa 90 env DART_GPU_ATTENTION=torch python3 -m \
        dart_client.apps.bench.gpu_shapes --base embedded --device cuda \
        --json "$R/shapes-embedded-sdpa.json"
      step attention-tree 120 python3 -m dart_client.apps.bench.gpu_shapes --base embedded \
        --device cuda --json "$R/shapes-embedded-tree-attention.json"
      step bench-sdpa 200 env DART_GPU_ATTENTION=torch python3 -m dart_client.apps.bench.cli \
        --device cuda --ngram "$NG" --workloads humaneval "$SG" --max-prompts 8 \
        --max-new-tokens 128 --methods ar dart --no-progress --output-dir "$R/bench-sdpa" ;;
    attention-batched) for b in 8 32; do for a in torch triton; do
        step "batched-$b-$a" 100 env DART_GPU_ATTENTION=$a python3 -m dart_client.apps.bench.batched \
          --device cuda --ngram "$NG" --batch "$b" --workloads humaneval --groups 4 \
          --max-new-tokens 64 --tree-budget auto --batch-tree-budget auto --methods ar-xN dart-xN \
          --output "$R/batched-$b-$a.json"
      done; done ;;
    real) step real 200 env DART_TEST_DEVICE=cuda DART_TEST_NGRAM="$NG" python3 -m pytest -q -s \
        -p no:cacheprovider tests/test_real_smollm2.py -k gpu_path ;;
    profile) step profile 90 python3 -m dart_client.apps.bench.step_profile --device cuda \
        --ngram "$NG" --head auto --prompts 4 --max-new 128 --json "$R/profile.json" ;;
    batched) for b in 8 32; do
        step "batched-$b" 150 python3 -m dart_client.apps.bench.batched --device cuda --ngram "$NG" \
          --batch "$b" --workloads humaneval --groups 1 --max-new-tokens 64 --tree-budget auto \
          --batch-tree-budget auto --methods dart-x1 ar-xN dart-xN --output "$R/batched-$b.json"
      done
      # Longer answers: decoding, not the prompts' admission, is most of the run.
      for b in 8 32; do
        step "batched-$b-256" 150 python3 -m dart_client.apps.bench.batched --device cuda \
          --ngram "$NG" --batch "$b" --workloads humaneval --groups 1 --max-new-tokens 256 \
          --tree-budget auto --batch-tree-budget auto --methods ar-xN dart-xN --ignore-eos \
          --output "$R/batched-$b-256.json"
      done ;;
    # The batches of `batched` (prompts joining at a step prefilled together, cuda's default)
    # with each prompt prefilled alone, as before 2026-11-28's admission change.
    admission) for b in 8 32; do
        step "batched-$b-alone" 150 python3 -m dart_client.apps.bench.batched --device cuda \
          --ngram "$NG" --batch "$b" --workloads humaneval --groups 1 --max-new-tokens 64 \
          --tree-budget auto --batch-tree-budget auto --methods ar-xN dart-xN --admission alone \
          --output "$R/batched-$b-alone.json"
      done ;;
    # What a batched step's tree building costs this host (its cores idle between steps).
    prune-host) step prune-host 45 python3 -m dart_client.apps.bench.batch_prune --model "$NG" \
        --calls 100 --json "$R/batch-prune.json" ;;
    eagle3) step eagle3 120 python3 -m dart_client.apps.bench.cli --device cuda --ngram "$NG" \
        --workloads humaneval "$SG" --max-prompts 3 --max-new-tokens 128 --methods ar dart eagle3 \
        --no-progress --output-dir "$R/eagle3" ;;
    generate) step generate 240 env DART_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
        tests/test_generate.py ;;
    # What docs/gpu.md "Waiting for a GPU" lists, most wanted first (about 9 minutes).
    next) for s in env prune-host static batched attention-batched admission real; do run "$s"; done ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
}
[ $# -gt 0 ] || set -- env static precision bench shapes shapes-real triton real profile batched eagle3 generate
for s in "$@"; do run "$s"; done
