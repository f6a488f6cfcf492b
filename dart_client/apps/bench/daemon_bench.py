"""The n-gram daemon against the in-process pruner, side by side in one run.

    python -m dart_client.apps.bench.daemon_bench --model MODEL.ngram [--requests 2000]
        [--seconds 3] [--clients 1 4 16] [--threads 2] [--busy-poll-us 2000] [--in-memory]
        [--skip-checksums] [--random-access] [--rss-after 10000]

Starts ``dart-ngram serve`` on an ephemeral loopback port, then measures on the same draft
requests (k = 25, 8 levels, default pruner configuration: beam 20, 60 nodes):

* latency: round-trip time of one prune request, one client, p50 and p99 (remote: the
  client's thread sleeps until the answer comes; remote, spin: it polls for the answer for up
  to ``SPIN`` seconds first, see ``dart_client.ngram.remote.DEFAULT_SPIN``), and the same call in
  process; and the round trip of an empty call (a health check), the transport's own floor;
* throughput: prunes per second with 1, 4 and 16 concurrent clients, each client its own
  process (as GPU workers are), remote and in process.

``--rss-after N`` then sends N more prunes (distinct drafts) through the daemon and reports its
resident memory (``VmRSS``, and the resident pages of its mapping of the model: what the prunes
touched, not the file's size; open the daemon with ``--skip-checksums`` for that, since checking
every checksum at open reads the whole file through the mapping, and ``--random-access``, since
otherwise each fault on a page in the page cache maps its neighbours too).

``--busy-poll-us`` starts the daemon busy-polling (``dart-ngram serve --busy-poll-us``: one
serving thread that keeps reading its sockets that long after each request instead of
sleeping); ``--in-memory`` opens the model in anonymous memory on huge pages, in the daemon
and in process alike.

Drafts look like the head's: each level's top-k ids are the model's own best continuations of
a context drawn from the model (so the n-gram lookups hit), topped up with random ids, with
softmaxed random logits as probabilities. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("remote", "in-process")
#: The latency table also has a row for a client that polls for its answer this long.
SPIN = 0.002
SPIN_KIND = f"remote, spin {SPIN * 1e3:g} ms"


@dataclass
class Draft:
    context: np.ndarray
    topk_ids: np.ndarray
    topk_probs: np.ndarray


def make_drafts(model_path: str, n: int, levels: int, k: int, seed: int) -> list[Draft]:
    """Draft-like requests whose ids are mostly continuations the model has seen."""
    from dart_client.ngram import NGram

    ng = NGram.open(model_path)
    rng = np.random.default_rng(seed)
    vocab = ng.vocab_size
    drafts = []
    for _ in range(n):
        # A context walked through the model: start anywhere, follow likely continuations.
        ctx = [int(rng.integers(vocab))]
        for _ in range(7):
            ids, probs = ng.top_k(ctx, 8)
            if len(ids) == 0:
                ctx.append(int(rng.integers(vocab)))
            else:
                p = probs / probs.sum()
                ctx.append(int(rng.choice(ids, p=p)))
        rows = np.empty((levels, k), dtype=np.int64)
        walk = list(ctx)
        for level in range(levels):
            ids, _ = ng.top_k(walk, k)
            row = list(dict.fromkeys(int(t) for t in ids))[: k - 5]
            while len(row) < k:
                t = int(rng.integers(vocab))
                if t not in row:
                    row.append(t)
            rows[level] = row
            walk.append(row[0])
        logits = rng.normal(size=(levels, k)) * 2.0
        logits[:, 0] += 2.0
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        drafts.append(Draft(np.asarray(ctx, dtype=np.int64), rows, probs.astype(np.float32)))
    return drafts


def make_pruner(kind: str, model_path: str, url: str, in_memory: bool = False) -> Any:
    from dart_client.ngram.pruner import PrunerConfig

    if kind.startswith("remote"):
        from dart_client.ngram import connect

        spin = SPIN if kind == SPIN_KIND else 0.0
        return connect(url, timeout=30, spin=spin).pruner(PrunerConfig())
    from dart_client.ngram import NGram
    from dart_client.ngram.pruner import Pruner

    return Pruner(NGram.open(model_path, in_memory=in_memory), PrunerConfig())


def latency(
    pruners: dict[str, Any], drafts: list[Draft], warmup: int = 200
) -> dict[str, tuple[float, float, int]]:
    """Per backend: (p50 us, p99 us, nodes of the last tree) of sequential prunes. The
    backends alternate request by request, so all see the same machine load, each on its own
    walk through the drafts: a prune right after another backend's prune of the same draft
    finds that draft's n-gram entries in the CPU caches (a large gain in process), which a
    real decode loop never does."""
    for d in drafts[:warmup]:
        for pruner in pruners.values():
            pruner.prune(d.context, d.topk_ids, d.topk_probs)
    times: dict[str, list[int]] = {name: [] for name in pruners}
    nodes: dict[str, int] = {}
    stride = max(1, len(drafts) // max(1, len(pruners)))
    for i in range(len(drafts)):
        for j, (name, pruner) in enumerate(pruners.items()):
            d = drafts[(i + j * stride) % len(drafts)]
            t0 = time.perf_counter_ns()
            tree = pruner.prune(d.context, d.topk_ids, d.topk_probs)
            times[name].append(time.perf_counter_ns() - t0)
            nodes[name] = len(tree)
    out = {}
    for name, ts in times.items():
        ts.sort()
        p99 = ts[min(len(ts) - 1, int(len(ts) * 0.99))] / 1e3
        out[name] = (statistics.median(ts) / 1e3, p99, nodes[name])
    return out


def empty_call_latency(remote: Any, n: int) -> tuple[float, float]:
    """(p50 us, p99 us) of health checks: the round trip with no work on either side."""
    for _ in range(min(n, 200)):
        remote.health()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        remote.health()
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return statistics.median(ts) / 1e3, ts[min(len(ts) - 1, int(len(ts) * 0.99))] / 1e3


def _client(
    kind: str,
    model_path: str,
    url: str,
    drafts: list[Draft],
    seconds: float,
    barrier: Any,
    out: Any,
    in_memory: bool,
) -> None:
    pruner = make_pruner(kind, model_path, url, in_memory)
    for d in drafts[:50]:
        pruner.prune(d.context, d.topk_ids, d.topk_probs)
    barrier.wait()
    done = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    i = 0
    while time.perf_counter() < deadline:
        d = drafts[i % len(drafts)]
        pruner.prune(d.context, d.topk_ids, d.topk_probs)
        done += 1
        i += 1
    out.put((done, time.perf_counter() - t0))


def throughput(
    kind: str,
    model_path: str,
    url: str,
    drafts: list[Draft],
    clients: int,
    seconds: float,
    in_memory: bool = False,
) -> float:
    """Prunes per second summed over ``clients`` processes running for ``seconds``."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_client,
            args=(
                kind,
                model_path,
                url,
                drafts[i::clients] or drafts,
                seconds,
                barrier,
                out,
                in_memory,
            ),
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join(60)
    return sum(done / elapsed for done, elapsed in results)


def rss_kb(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``RssFile`` of a process, in kB (Linux)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def mapping_rss_kb(pid: int, path: str) -> int:
    """Resident kB of a process's mappings of the file ``path`` (``/proc/PID/smaps``)."""
    target = os.path.realpath(path)
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[:1] == ["Rss:"]:
                total += int(fields[1])
    return total


def rss_after_prunes(
    remote: Any, drafts: list[Draft], n: int, pid: int, model: str
) -> dict[str, float]:
    """The daemon's resident memory before and after ``n`` prunes through it (drafts cycled)."""
    before = {**rss_kb(pid), "model": mapping_rss_kb(pid, model)}
    t0 = time.perf_counter()
    for i in range(n):
        d = drafts[i % len(drafts)]
        remote.prune(d.context, d.topk_ids, d.topk_probs)
    seconds = time.perf_counter() - t0
    after = {**rss_kb(pid), "model": mapping_rss_kb(pid, model)}
    return {
        **{f"{k}_before_kb": v for k, v in before.items()},
        **{f"{k}_after_kb": v for k, v in after.items()},
        "prunes": n,
        "prunes_per_s": n / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the .ngram model to serve")
    ap.add_argument("--requests", type=int, default=2000, help="latency samples")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of a throughput run")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--threads", type=int, default=None, help="daemon --threads")
    ap.add_argument("--repeat", type=int, default=2, help="throughput runs (best kept)")
    ap.add_argument("--levels", type=int, default=8)
    ap.add_argument("--k", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--busy-poll-us",
        type=int,
        default=0,
        help="daemon --busy-poll-us (0: the daemon sleeps between requests)",
    )
    ap.add_argument(
        "--in-memory",
        action="store_true",
        help="open the model in anonymous memory on huge pages (daemon and in process)",
    )
    ap.add_argument(
        "--skip-checksums",
        action="store_true",
        help="daemon --skip-checksums (open reads only the small sections)",
    )
    ap.add_argument(
        "--random-access",
        action="store_true",
        help="daemon --random-access (MADV_RANDOM: a fault maps only its own page)",
    )
    ap.add_argument(
        "--rss-after",
        type=int,
        default=0,
        metavar="N",
        help="then send N prunes through the daemon and report its resident memory",
    )
    args = ap.parse_args(argv)

    from dart_client.ngram.daemon import LocalDaemon

    extra: list[str] = []
    if args.threads:
        extra += ["--threads", str(args.threads)]
    if args.busy_poll_us:
        extra += ["--busy-poll-us", str(args.busy_poll_us)]
    if args.in_memory:
        extra += ["--in-memory"]
    if args.skip_checksums:
        extra += ["--skip-checksums"]
    if args.random_access:
        extra += ["--random-access"]
    with LocalDaemon(args.model, *extra) as daemon:
        url = daemon.url
        drafts = make_drafts(args.model, args.requests, args.levels, args.k, args.seed)

        rows = []
        pruners = {
            kind: make_pruner(kind, args.model, url, args.in_memory) for kind in (*KINDS, SPIN_KIND)
        }
        lat = latency(pruners, drafts)
        empty = empty_call_latency(pruners["remote"].ngram, args.requests)
        empty_spin = empty_call_latency(pruners[SPIN_KIND].ngram, args.requests)
        # The best of `repeat` runs, alternating backends: on a shared machine the load of
        # others only ever slows a run down.
        tput: dict[tuple[str, int], float] = {}
        for _ in range(args.repeat):
            for c in args.clients:
                for kind in KINDS:
                    t = throughput(kind, args.model, url, drafts, c, args.seconds, args.in_memory)
                    tput[(kind, c)] = max(t, tput.get((kind, c), 0.0))
        for kind in (KINDS[0], SPIN_KIND, *KINDS[1:]):
            p50, p99, _nodes = lat[kind]
            # Throughput of polling clients: not measured (with more client processes than
            # idle CPUs they take CPU time from the daemon; see DEFAULT_SPIN).
            rows.append(
                [kind, f"{p50:.1f}", f"{p99:.1f}"]
                + [f"{tput[(kind, c)]:,.0f}" if kind in KINDS else "—" for c in args.clients]
            )
        print(
            f"\nPrune requests: k = {args.k}, {args.levels} levels, beam 20, 60 nodes "
            f"(trees of {lat['remote'][2]} nodes); model {args.model}; "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); "
            f"daemon --threads {args.threads or 'default'}, --busy-poll-us "
            f"{args.busy_poll_us}{', --in-memory' if args.in_memory else ''}; clients are "
            "processes.\n"
        )
        header = ["backend", "p50 (us)", "p99 (us)"] + [
            f"{c} client{'s' if c > 1 else ''} (prunes/s)" for c in args.clients
        ]
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(" --- " for _ in header) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print(
            f"\nRound trip of an empty call (health check), one client: p50 {empty[0]:.1f} us, "
            f"p99 {empty[1]:.1f} us (spin {SPIN * 1e3:g} ms: p50 {empty_spin[0]:.1f} us, p99 "
            f"{empty_spin[1]:.1f} us)."
        )
        if args.rss_after:
            more = make_drafts(args.model, args.rss_after, args.levels, args.k, args.seed + 1)
            r = rss_after_prunes(
                pruners["remote"], more, args.rss_after, daemon.proc.pid, args.model
            )
            print(
                f"\nDaemon resident memory after {r['prunes']:,} more prunes "
                f"({r['prunes_per_s']:,.0f}/s, one client): VmRSS {r['VmRSS_after_kb']:,} kB, "
                f"of which the model's mapped pages {r['model_after_kb']:,} kB and anonymous "
                f"memory {r['RssAnon_after_kb']:,} kB; before them VmRSS "
                f"{r['VmRSS_before_kb']:,} kB (model pages {r['model_before_kb']:,} kB); model "
                f"file {os.path.getsize(args.model):,} bytes."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
