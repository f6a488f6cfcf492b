"""The training loop: online target features, prefix-shared masked training, annealed KL.

Every piece of state that decides the next step is in the checkpoint (head weights, AdamW
moments, scheduler, RNG states, the global data cursor), and everything random about a step
(the data order, the anchors of a window) is a pure function of the seed and the cursor, so
a resumed run takes exactly the steps an uninterrupted one would. Under ``torchrun`` each
process takes its share of every step's windows and the gradients are all-reduced (gloo on
CPU, NCCL on GPUs): the same code runs with one process or many.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from dart_client.errors import DartError
from dart_client.loading import DTYPES
from dart_client.models.head import DartHead
from dart_client.train.data import TrainingSet
from dart_client.train.forward import (
    head_forward_layout,
    target_outputs,
    training_targets,
)
from dart_client.train.loss import annealed_kl, distinct_targets
from dart_client.train.masks import batch_layout, sample_anchors
from dart_client.train.vocab import build_draft_vocab, coverage, token_counts


class TrainError(DartError):
    """A training run that cannot start or resume as asked."""


@dataclass
class TrainConfig:
    """Every setting of a run; stored in each checkpoint and in the output's README."""

    output_dir: str
    draft_length: int = 3
    draft_vocab_size: int = 8192
    anchors: int = 24
    batch_size: int = 1
    grad_accum: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 50
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    clip: float = 0.5
    gamma: float = 0.6
    head_dtype: str = "fp32"
    seed: int = 0
    double_final_norm: bool = False
    checkpoint_every_s: float = 600.0
    checkpoint_every_steps: int = 0
    keep_checkpoints: int = 2
    log_every: int = 10
    device: str = "cpu"
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = {
            "draft_length": self.draft_length,
            "draft_vocab_size": self.draft_vocab_size,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "total_steps": self.total_steps,
            "keep_checkpoints": self.keep_checkpoints,
            "log_every": self.log_every,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise TrainError(f"{name} = {value!r}; expected a positive integer")
        if self.anchors < 0 or self.warmup_steps < 0 or self.checkpoint_every_steps < 0:
            raise TrainError("anchors, warmup_steps and checkpoint_every_steps must be >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainError(f"lr = {self.lr!r}; expected a positive finite number")
        if not 0 < self.gamma <= 1:
            raise TrainError(f"gamma = {self.gamma!r}; expected 0 < gamma <= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainError(f"min_lr_ratio = {self.min_lr_ratio!r}; expected 0..1")
        if self.clip <= 0:
            raise TrainError(f"clip = {self.clip!r}; expected > 0")
        if self.head_dtype not in DTYPES:
            raise TrainError(f"head_dtype {self.head_dtype!r}; expected one of {list(DTYPES)}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def release_free_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Windows of varying length allocate activations of varying size; glibc keeps the freed
    chunks in its arenas, so without this a long CPU run's RSS grew from 2 to 5.4 GB in two
    hours without holding more live data.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


class _StopFlag:
    """SIGTERM/SIGINT end the loop after the current step (the caller then checkpoints),
    instead of killing the run mid-step and losing up to a checkpoint interval of work."""

    def __init__(self) -> None:
        self.set = False
        self.previous: Any = None

    @classmethod
    def install(cls) -> _StopFlag:
        flag = cls()
        if threading_main():

            def handler(signum: int, _frame: object) -> None:
                flag.set = True

            flag.previous = signal.signal(signal.SIGTERM, handler)
        return flag

    def uninstall(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(device: str) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (no-op for a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
        # A group left for the interpreter's teardown can abort the process ("terminate
        # called without an active exception" from gloo's threads); leave it in order.
        atexit.register(_leave_process_group)
    return dist_info()


@dataclass
class StepLog:
    step: int
    tokens: int
    loss: float
    kl: list[float]
    acc: list[float]
    lr: float
    tokens_per_s: float
    elapsed_s: float


class Trainer:
    """Trains a :class:`DartHead` on a frozen target over a :class:`TrainingSet`.

    A subclass trains another draft model of the same layout family (``head_class``) by
    overriding :meth:`_micro_step`; data, schedule, checkpoints and resume stay these."""

    head_class: type[DartHead] = DartHead

    def __init__(
        self,
        config: TrainConfig,
        target: nn.Module,
        train_set: TrainingSet,
        *,
        always_in_vocab: tuple[int, ...] = (),
        head: DartHead | None = None,
    ) -> None:
        self.config = config
        self.rank, self.world = dist_info()
        self.device = torch.device(config.device)
        self.target = target.to(self.device).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.data = train_set
        self.out = Path(config.output_dir)
        vocab_size = self.target.get_input_embeddings().weight.shape[0]
        counts = token_counts((train_set[i] for i in range(len(train_set))), vocab_size)
        if head is None:
            size = min(config.draft_vocab_size, vocab_size)
            ids, _, _ = build_draft_vocab(counts, size, always=always_in_vocab)
            self.vocab_coverage = coverage(counts, ids)
            head = self.head_class.random_init(
                self.target.config,
                draft_length=config.draft_length,
                draft_vocab=ids,
                double_final_norm=config.double_final_norm,
                seed=config.seed,
            )
            with torch.no_grad():
                # Row i of lm_head starts as the target's output row of draft token i: the
                # head then begins from the target's own reading of a hidden state.
                out_w = self.target.get_output_embeddings().weight
                head.lm_head.weight.copy_(out_w[ids].to(head.lm_head.weight.dtype))
        else:  # an inherited vocabulary: how much of this data it covers
            self.vocab_coverage = coverage(counts, head.draft_to_target.cpu())
        if head.config.draft_length != config.draft_length:
            raise TrainError(
                f"head has draft_length {head.config.draft_length}, config {config.draft_length}"
            )
        head.check_compatible(self.target.config)
        self.head = head.to(device=self.device, dtype=torch.float32)
        self.head.bind_embedding(self.target.get_input_embeddings())
        self.head.train()
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, config.warmup_steps, config.total_steps, config.min_lr_ratio),
        )
        self.step = 0
        self.cursor = 0  # global windows consumed, all processes together
        self.tokens = 0  # real tokens through the target, all processes together
        self.elapsed = 0.0
        self.draft_to_target = self.head.draft_to_target.to(self.device)

    # -- data -------------------------------------------------------------------------------

    def _window_index(self, g: int) -> int:
        n = len(self.data)
        epoch, pos = divmod(g, n)
        order = np.random.default_rng([self.config.seed, 0, epoch]).permutation(n)
        return int(order[pos])

    def _micro_batches(self, cursor: int) -> list[list[int]]:
        """The window indices of this process, per micro-batch, for the step at ``cursor``."""
        cfg = self.config
        out = []
        for k in range(cfg.grad_accum):
            first = cursor + (k * self.world + self.rank) * cfg.batch_size
            out.append([first + i for i in range(cfg.batch_size)])
        return out

    @property
    def num_rows(self) -> int:
        """Rows of per-row statistics a step logs (the head's rows, 0..m)."""
        return self.config.draft_length + 1

    @property
    def windows_per_step(self) -> int:
        return self.config.grad_accum * self.world * self.config.batch_size

    # -- one micro-batch --------------------------------------------------------------------

    def _target_batch(self, globals_: list[int]) -> tuple[list[Any], list[int], torch.Tensor, Any]:
        """The micro-batch's windows, their lengths, their right-padded ids (on the device)
        and the frozen target's outputs over them."""
        seqs = [self.data[self._window_index(g)] for g in globals_]
        lengths = [len(ids) for ids, _ in seqs]
        t_max = max(lengths)
        input_ids = torch.zeros(len(seqs), t_max, dtype=torch.long)
        attn = torch.zeros(len(seqs), t_max, dtype=torch.long)
        for b, (ids, _) in enumerate(seqs):
            input_ids[b, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            attn[b, : len(ids)] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        tgt = target_outputs(self.target, input_ids, attn, self.draft_to_target)
        return seqs, lengths, input_ids, tgt

    def _micro_step(self, globals_: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of one micro-batch (already scaled for accumulation) and its row stats
        ``(3, d)``: KL sums, correct, counts, plus the token count in a 4th row."""
        cfg = self.config
        m = cfg.draft_length
        seqs, lengths, _, tgt = self._target_batch(globals_)
        t_max = max(lengths)
        anchors = [
            sample_anchors(mask, m, cfg.anchors, np.random.default_rng([cfg.seed, 1, g]))
            for (_, mask), g in zip(seqs, globals_, strict=True)
        ]
        n_real = t_max - 1
        # Head parameters are float32 masters; "bf16" runs the head's matmuls under autocast.
        mask4d, positions, _ = batch_layout([n_real] * len(seqs), anchors, m, torch.float32)
        slots = mask4d.shape[-1] - n_real
        taps = tgt.taps[:, :n_real].float()
        next_emb = tgt.embeds[:, 1 : n_real + 1].float()
        autocast = cfg.head_dtype == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = head_forward_layout(
                self.head, taps, next_emb, slots, mask4d.to(self.device), positions.to(self.device)
            )
        idx = training_targets(
            lengths, [torch.from_numpy(mk) for _, mk in seqs], anchors, n_real, m
        )
        idx_b, idx_l = idx.batch.to(self.device), idx.line.to(self.device)
        draft = logits[idx_b, idx_l]
        # A position is the target of several anchors' rows: its softmax is taken once.
        target, target_rows = distinct_targets(tgt.logits, idx_b, idx.target_pos.to(self.device))
        weights = torch.ones(draft.shape[0], device=self.device)
        loss, stats = annealed_kl(
            draft, target, idx.row.to(self.device), weights, m + 1, cfg.gamma, target_rows
        )
        summary = torch.stack(
            [
                stats.kl_sum,
                stats.correct,
                stats.count,
                torch.full_like(stats.count, float(sum(lengths))),
            ]
        ).cpu()
        return loss / cfg.grad_accum, summary

    # -- the loop ---------------------------------------------------------------------------

    def train(
        self, max_steps: int | None = None, time_limit_s: float | None = None
    ) -> list[StepLog]:
        """Run to ``total_steps`` (or ``max_steps`` more steps, or the time limit)."""
        cfg = self.config
        logs: list[StepLog] = []
        stop_at = (
            cfg.total_steps if max_steps is None else min(cfg.total_steps, self.step + max_steps)
        )
        bar = tqdm(
            total=cfg.total_steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not cfg.progress or self.rank != 0,
        )
        window_stats = torch.zeros(4, self.num_rows, dtype=torch.float64)
        window_loss, window_steps, window_t0 = 0.0, 0, time.perf_counter()
        last_ckpt = time.monotonic()
        run_t0 = time.monotonic()
        elapsed0 = self.elapsed
        stop_requested = _StopFlag.install()
        try:
            while self.step < stop_at and not self._agree(stop_requested.set):
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), dtype=torch.float64)
                step_stats = torch.zeros(4, self.num_rows, dtype=torch.float64)
                for globals_ in self._micro_batches(self.cursor):
                    loss, stats = self._micro_step(globals_)
                    loss.backward()
                    step_loss += loss.detach().double().cpu()
                    step_stats += stats
                self._all_reduce_grads()
                if self.world > 1:
                    dist.all_reduce(step_loss)
                    dist.all_reduce(step_stats)
                    step_loss /= self.world
                if not torch.isfinite(step_loss):
                    raise TrainError(
                        f"step {self.step}: loss is {step_loss.item()}; lower the learning rate "
                        f"(now {self.scheduler.get_last_lr()[0]:.3g}) or use fp32"
                    )
                torch.nn.utils.clip_grad_norm_(self.params, cfg.clip)
                self.optimizer.step()
                self.scheduler.step()
                self.step += 1
                self.cursor += self.windows_per_step
                self.tokens += int(step_stats[3, 0].item())
                self.elapsed = elapsed0 + (time.monotonic() - run_t0)
                window_stats += step_stats
                window_loss += float(step_loss)
                window_steps += 1
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == stop_at:
                    log = self._log(
                        window_stats, window_loss / window_steps, time.perf_counter() - window_t0
                    )
                    logs.append(log)
                    bar.set_postfix_str(
                        f"loss {log.loss:.3f} acc " + " ".join(f"{a:.2f}" for a in log.acc)
                    )
                    window_stats.zero_()
                    window_loss, window_steps, window_t0 = 0.0, 0, time.perf_counter()
                    release_free_heap()
                due_time = time.monotonic() - last_ckpt >= cfg.checkpoint_every_s
                due_steps = (
                    cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps == 0
                )
                if self._agree(bool(due_time or due_steps)):
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()
                if time_limit_s is not None and self._agree(
                    time.monotonic() - run_t0 >= time_limit_s
                ):
                    break
        finally:
            stop_requested.uninstall()
            bar.close()
        return logs

    def _agree(self, flag: bool) -> bool:
        """Rank 0's decision, shared, so every process checkpoints or stops together."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0])
        dist.broadcast(t, 0)
        return bool(t.item())

    def _all_reduce_grads(self) -> None:
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def _log(self, stats: torch.Tensor, loss: float, seconds: float) -> StepLog:
        kl = (stats[0] / stats[2].clamp_min(1)).tolist()
        acc = (stats[1] / stats[2].clamp_min(1)).tolist()
        tokens = float(stats[3, 0])
        log = StepLog(
            step=self.step,
            tokens=self.tokens,
            loss=loss,
            kl=kl,
            acc=acc,
            lr=float(self.scheduler.get_last_lr()[0]),
            tokens_per_s=tokens / max(seconds, 1e-9),
            elapsed_s=self.elapsed,
        )
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with (self.out / "train_log.jsonl").open("a") as f:
                f.write(json.dumps(dataclasses.asdict(log)) + "\n")
        return log

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes ``checkpoints/step-XXXXXXXX`` atomically; all processes wait."""
        path = self.checkpoint_root / f"step-{self.step:08d}"
        if self.rank == 0:
            tmp = path.with_name(path.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            self.head.save_pretrained(tmp / "head")
            state = {
                "step": self.step,
                "cursor": self.cursor,
                "tokens": self.tokens,
                "elapsed": self.elapsed,
                "world": self.world,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": {
                    "torch": torch.get_rng_state(),
                    "numpy": np.random.get_state(),
                    "python": random.getstate(),
                },
                "config": self.config.to_dict(),
                "vocab_coverage": self.vocab_coverage,
            }
            torch.save(state, tmp / "state.pt")
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
            (self.checkpoint_root / "latest").write_text(path.name + "\n")
            done = sorted(
                p for p in self.checkpoint_root.glob("step-*") if not p.name.endswith(".tmp")
            )
            for old in done[: -self.config.keep_checkpoints]:
                shutil.rmtree(old)
        if self.world > 1:
            dist.barrier()
        return path

    def latest_checkpoint(self) -> Path | None:
        pointer = self.checkpoint_root / "latest"
        if not pointer.is_file():
            return None
        path = self.checkpoint_root / pointer.read_text().strip()
        return path if path.is_dir() else None

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; the run continues bit for bit."""
        path = Path(path)
        state_path = path / "state.pt"
        if not state_path.is_file():
            raise TrainError(f"{path}: not a checkpoint (no state.pt)")
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        saved = state["config"]
        for key in (
            "draft_length",
            "draft_vocab_size",
            "batch_size",
            "grad_accum",
            "seed",
            "anchors",
        ):
            if saved.get(key) != getattr(self.config, key):
                raise TrainError(
                    f"{path}: checkpoint has {key} = {saved.get(key)!r}, this run "
                    f"{getattr(self.config, key)!r}; resume with the same setting"
                )
        if state["world"] != self.world:
            raise TrainError(
                f"{path}: written by {state['world']} processes, resumed with {self.world}; "
                "the data order depends on it"
            )
        loaded = self.head_class.from_pretrained(path / "head")
        with torch.no_grad():
            self.head.load_state_dict(loaded.state_dict())
        self.draft_to_target = self.head.draft_to_target.to(self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.tokens = int(state["tokens"])
        self.elapsed = float(state["elapsed"])
        self.vocab_coverage = float(state.get("vocab_coverage", float("nan")))

    def export(self, directory: str | Path, dtype: str = "bf16") -> Path:
        """The trained head in the published layout (``config.json`` + ``model.safetensors``)."""
        directory = Path(directory)
        if self.rank == 0:
            head = self.head_class(self.head.config)
            head.load_state_dict(self.head.state_dict())
            head.to(DTYPES[dtype]).save_pretrained(directory)
        if self.world > 1:
            dist.barrier()
        return directory
