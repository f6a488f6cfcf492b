"""``dart-bench`` output: a JSON record, a Markdown table and PNG plots.

* ``results.json`` -- the environment, the settings, per workload and method every metric,
  per prompt the median time and token count of each method, the tree-budget tuning curve;
* ``results.md`` -- one table per workload (tokens/s, speedup, tau, stage shares, greedy
  equality) and the tuning curve;
* ``speedup.png`` (speedup over autoregressive per workload and method),
  ``time_breakdown.png`` (share of each stage per DART method),
  ``tau_histogram.png`` (accepted tokens per step), ``tree_budget.png`` (the tuning curve).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dart_client.apps.bench.harness import WorkloadRuns
from dart_client.decoding.loop import STAGES

#: generate.STAGES plus the time outside them (Python between stages, stream bookkeeping).
SHOWN_STAGES = (*(s for s in STAGES if s != "prefill"), "prefill", "other")


def per_prompt(results: Sequence[WorkloadRuns]) -> dict[str, list[dict[str, Any]]]:
    """Per workload, per prompt: id, prompt tokens, per method median seconds and tokens."""
    import statistics

    out: dict[str, list[dict[str, Any]]] = {}
    for wr in results:
        rows = []
        for pr in wr.prompts:
            row: dict[str, Any] = {
                "id": pr.prompt.id,
                "prompt_tokens": len(pr.prompt.ids),
                "preview": pr.prompt.preview,
            }
            for name, runs in pr.runs.items():
                row[name] = {
                    "seconds": statistics.median(r.elapsed for r in runs),
                    "tokens": len(runs[0].tokens),
                }
            rows.append(row)
        out[wr.workload.name] = rows
    return out


def build_record(
    summary: dict[str, Any],
    results: Sequence[WorkloadRuns],
    environment: dict[str, Any],
    settings: dict[str, Any],
    methods: dict[str, str],
    notes: list[str],
    tuning: dict[str, Any] | None,
    eagle3_tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "environment": environment,
        "settings": settings,
        "methods": methods,
        "notes": notes,
        "workloads": summary,
        "per_prompt": per_prompt(results),
        "tree_budget_tuning": tuning,
        "eagle3_tree_tuning": eagle3_tuning,
    }


def _ties(found: list[dict[str, Any]] | None) -> str:
    """What the target's margins say of the divergences: all near-ties, or which are not."""
    if not found:
        return ""
    bad = [d for d in found if not d["near_tie"]]
    if not bad:
        return ": each at a near-tie of the target's logits"
    worst = max(bad, key=lambda d: d["margin"] - d["threshold"])
    return (
        f": {len(bad)} NOT at a near-tie (token {worst['token']}: margin "
        f"{worst['margin']:.3f} > {worst['threshold']:.3f})"
    )


def _fmt(v: Any, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def markdown(record: dict[str, Any]) -> str:
    """The Markdown report: settings, one table per workload, notes, the tuning curve."""
    env = record["environment"]
    st = record["settings"]
    mode = "greedy" if st["temperature"] == 0 else f"sampling T={st['temperature']}"
    lines = [
        "# dart-bench",
        "",
        f"`{env.get('command', 'dart-bench')}`",
        "",
        f"{env.get('target', '?')} ({env.get('dtype')}, {env.get('device')}"
        f"{', ' + env['gpu'] if env.get('gpu') else ''}"
        f"{', Triton kernels' if env.get('gpu_kernels') == 'triton' else ''}"
        f"{', Triton tree attention' if env.get('gpu_attention') == 'triton' else ''}), "
        f"{env.get('cpu')}, {env.get('torch_threads')} threads, load average at start "
        f"{_load(env.get('load_average'))}; {mode}, batch 1, {st['max_new_tokens']} new "
        f"tokens at most, {st['repetitions']} repetitions (medians), methods interleaved.",
        "",
    ]
    for name, w in record["workloads"].items():
        lines += [
            f"## {name} ({w['prompts']} prompts)",
            "",
            "| method | tok/s | speedup | tau | mean tree | draft ms/step | draft | prune | "
            "verify | accept+compact | greedy == AR |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m, r in w["methods"].items():
            sh = r["stage_share"] or {}
            ac = (sh["accept"] + sh["compact"]) if sh else None
            eq = r["greedy_equal_ar"]
            eq_text = "–" if eq is None else f"{eq}/{r['prompts']}"
            if r.get("greedy_first_difference"):
                eq_text += (
                    f" (differs at token {', '.join(map(str, r['greedy_first_difference']))}"
                    f"{_ties(r.get('greedy_divergences'))})"
                )
            lines.append(
                f"| {m} | {r['tokens_per_s']:.1f} | {_fmt(r['speedup'], '.2f')}x | "
                f"{_fmt(r['tau'], '.2f')} | {_fmt(r['mean_tree_nodes'], '.1f')} | "
                f"{_fmt(r.get('draft_ms_per_step'), '.2f')} | {_pct(sh.get('draft'))} | "
                f"{_pct(sh.get('prune'))} | "
                f"{_pct(sh.get('verify'))} | {_pct(ac)} | "
                f"{eq_text} |"
            )
        for note in w["notes"]:
            lines.append(f"\n{name}: {note}")
        lines.append("")
    if record["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in record["notes"]] + [""]
    from dart_client.decoding.autotune import budget_tuning_table, eagle3_tuning_table

    tuning = record.get("tree_budget_tuning")
    if tuning:
        lines += ["## Tree budget (auto)", "", budget_tuning_table(tuning), ""]
    eagle3_tuning = record.get("eagle3_tree_tuning")
    if eagle3_tuning:
        table = eagle3_tuning_table(eagle3_tuning, rows=12)
        lines += ["## EAGLE-3 tree (eagle3-auto), the 12 fastest", "", table, ""]
    methods = record["methods"]
    lines += ["## Methods", ""] + [f"- `{k}`: {v}" for k, v in methods.items()] + [""]
    return "\n".join(lines)


def _load(load: Any) -> str:
    return "?" if not load else f"{load[0]:.1f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


# -- plots ---------------------------------------------------------------------------------------


def plots(record: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the PNG plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    workloads = record["workloads"]
    names = list(workloads)
    methods: list[str] = []
    for w in workloads.values():
        methods += [m for m in w["methods"] if m not in methods]
    shown = [m for m in methods if m != "ar"]

    # Speedup per workload, grouped bars per method.
    fig, ax = plt.subplots(figsize=(min(12, max(6, 1.2 * len(names) * max(1, len(shown)))), 4))
    width = 0.8 / max(1, len(shown))
    for j, m in enumerate(shown):
        values = [workloads[n]["methods"].get(m, {}).get("speedup") or 0.0 for n in names]
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, values, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("speedup over autoregressive (tokens/s)")
    ax.set_title("Speedup per workload")
    ax.legend(fontsize=8)
    written.append(_save(fig, out_dir / "speedup.png"))

    # Time breakdown of each method with stage timings (pooled over workloads).
    staged = [m for m in methods if _pooled_shares(workloads, m) is not None]
    fig, ax = plt.subplots(figsize=(7, 0.6 * max(2, len(staged)) + 1.5))
    for i, m in enumerate(staged):
        shares = _pooled_shares(workloads, m) or {}
        left = 0.0
        for s in SHOWN_STAGES:
            v = shares.get(s, 0.0)
            ax.barh(i, v, left=left, color=_STAGE_COLORS[s], label=s if i == 0 else None)
            left += v
    ax.set_yticks(range(len(staged)), staged)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of generation time")
    ax.set_title("Time breakdown")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    written.append(_save(fig, out_dir / "time_breakdown.png"))

    # Accepted tokens per step.
    dart = [m for m in methods if m.startswith("dart")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(dart))
    for j, m in enumerate(dart):
        hist: dict[int, int] = {}
        for w in workloads.values():
            for k, v in (w["methods"].get(m, {}).get("accept_histogram") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + v
        total = sum(hist.values()) or 1
        ks = sorted(hist)
        ax.bar(
            [k + (j - (len(dart) - 1) / 2) * width for k in ks],
            [hist[k] / total for k in ks],
            width,
            label=m,
        )
    ax.set_xlabel("tokens per step (accepted drafts + bonus)")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted length per step")
    if dart:
        ax.legend(fontsize=8)
    written.append(_save(fig, out_dir / "tau_histogram.png"))

    tuning = record.get("tree_budget_tuning")
    if tuning:
        curve = tuning["curve"]
        fig, ax = plt.subplots(figsize=(7, 4))
        b = [p["budget"] for p in curve]
        ax.plot(b, [p["tokens_per_s"] for p in curve], marker="o", label="est. tokens/s")
        ax.axvline(tuning["best_budget"], color="green", linestyle="--", label="chosen")
        ax.axvline(60, color="gray", linestyle=":", label="reference (GPU) 60")
        ax.set_xlabel("tree budget (draft nodes)")
        ax.set_ylabel("estimated tokens/s")
        ax2 = ax.twinx()
        ax2.plot(b, [p["verify_ms"] for p in curve], color="red", marker=".", label="verify ms")
        ax2.set_ylabel("verification forward (ms)")
        ax.set_title("Tree budget tuning on this machine")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
        written.append(_save(fig, out_dir / "tree_budget.png"))
    return written


_STAGE_COLORS = {
    "draft": "#4c72b0",
    "prune": "#dd8452",
    "verify": "#55a868",
    "accept": "#c44e52",
    "compact": "#8172b3",
    "inputs": "#da8bc3",
    "emit": "#ccb974",
    "prefill": "#937860",
    "other": "#bbbbbb",
}


def _pooled_shares(workloads: dict[str, Any], method: str) -> dict[str, float] | None:
    """Stage shares averaged over workloads (each weighted by its time)."""
    acc: dict[str, float] = {}
    weight = 0.0
    for w in workloads.values():
        r = w["methods"].get(method)
        if not r or not r["stage_share"]:
            continue
        for s, v in r["stage_share"].items():
            acc[s] = acc.get(s, 0.0) + v * r["seconds"]
        weight += r["seconds"]
    if not acc or weight <= 0:
        return None
    return {s: v / weight for s, v in acc.items()}


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(record: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.json, results.md and the plots under ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(record, indent=2) + "\n")
    paths["markdown"].write_text(markdown(record))
    for p in plots(record, out):
        paths[p.stem] = p
    return paths
