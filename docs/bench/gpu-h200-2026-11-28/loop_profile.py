"""Where an AR token's time goes in the generation loop on cuda (kernels vs host):
python docs/bench/gpu-h200-2026-11-28/loop_profile.py [NGRAM] (docs/gpu.md)."""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dart_client import ar_generate, dart_generate
from dart_client.dart_model import build_model

ngram = sys.argv[1] if len(sys.argv) > 1 else "embedded"
dm = build_model(None, "auto", ngram, dtype="bf16", device="cuda")
model = dm.target.model
print(
    "attn",
    model.config._attn_implementation,
    "dtype",
    model.dtype,
    "tied",
    model.config.tie_word_embeddings,
)
text = dm.template.format(
    messages=[
        {
            "role": "user",
            "content": "Write a Python function that reverses a string and explain it.",
        }
    ]
)
ids = dm.tokenizer(text, add_special_tokens=False)["input_ids"]
for method in ("ar", "dart"):
    gen = ar_generate if method == "ar" else dart_generate
    for _ in range(2):
        r = gen(dm, input_ids=ids, max_new_tokens=96)
        print(
            method,
            len(r.tokens),
            "tok",
            f"{r.tokens_per_second:.1f} tok/s steps {r.steps}",
            {k: round(v * 1000 / r.steps, 3) for k, v in r.timings.items()},
        )
    print("pool capacities", [c.capacity for c in dm.target.__dict__.get("_static_caches", [])])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        r = gen(dm, input_ids=ids, max_new_tokens=96)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    dev = sum(float(getattr(e, "self_device_time_total", 0.0)) for e in ev) / 1000
    print(
        f"{method} profiled: {r.steps} steps, wall {wall * 1000 / r.steps:.3f} ms/step, "
        f"kernels {dev / r.steps:.3f} ms/step"
    )
    print(ev.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
