"""The workload every system trains: a byte-level decoder-only transformer on the Python docs.

- Text: bench.swarm.corpus (python3-doc's reStructuredText, split by file, fixed).
- Tokens: bytes (vocabulary 256), so the loss is in nats per byte and the byte unigram
  entropy of the training text is the "learnt nothing" line.
- Model: pre-norm GPT blocks, learned positions, tied input/output embedding. `build_model`
  seeds its own generator with MODEL_SEED: every host of every system of every run starts
  from the same weights.
- Batches: windows at random offsets of the training bytes, from a generator seeded by
  (seed, host, samples already seen), so hosts see different data, a resumed worker does
  not replay its first batches, and a run's seed sets its data order.
- Validation: VAL_WINDOWS fixed windows of the model's context from the validation files
  (4 KB), cheap enough to score every snapshot of a curve; `evaluate` is deterministic and the
  same for every system.
- Held out: HELD_OUT_WINDOWS disjoint windows of the validation files (256 KB of scored
  bytes, `held_out_windows`), the same bytes for every row; the models a table scores at the
  end of the budget are evaluated on them.

`python -m bench.swarm.workload --alone --minutes 3` trains one process alone and prints how
far below the unigram entropy it gets (the check that the workload is learnable in the time a
benchmark run has).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench.swarm.corpus import load_corpus, unigram_entropy

VOCAB = 256
VAL_WINDOWS = 64
VAL_SEED = 20261124
HELD_OUT_WINDOWS = 4096  # x 64 scored bytes = 256 KB
HELD_OUT_SEED = 20261125
MODEL_SEED = 0  # every run's initial weights, whatever its data seed
EVAL_CHUNK = 256  # windows per forward pass when evaluating


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    context: int  # positions the model has: the training windows' length and validation's

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


PRESETS = {
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, context=64),  # smoke tests
    "small": ModelConfig(d_model=144, n_layers=4, n_heads=4, context=64),  # ~1M parameters
}


@dataclass(frozen=True)
class Hyper:
    """The training settings every system shares (the orchestrator's defaults)."""

    batch: int = 8
    seq_len: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1


DEFAULT_HYPER = Hyper()


def model_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}") from None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, 256) for int64 tokens (batch, seq)."""
        if tokens.shape[1] > self.cfg.context:
            raise ValueError(f"sequence of {tokens.shape[1]} > context {self.cfg.context}")
        h = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.embed.weight.T  # tied output embedding


def build_model(name: str = "small", seed: int = 0) -> ByteLM:
    """The preset's model with GPT-2-style initialisation from its own seeded generator."""
    cfg = model_config(name)
    model = ByteLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.zero_()
            elif "ln" in pname.split(".")[-2]:
                p.fill_(1.0)
            else:
                std = residual_std if pname.endswith(("proj.weight", "out.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lm_loss(module: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of windows (batch, seq+1); `module` may be a
    wrapper such as DistributedDataParallel."""
    logits = module(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))


def param_groups(model: nn.Module, hyper: Hyper) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases, norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": hyper.weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def adamw(groups: Any, hyper: Hyper) -> torch.optim.AdamW:
    """The inner optimizer of every system (hivemind builds it from its own param groups)."""
    return torch.optim.AdamW(groups, lr=hyper.lr)


def make_optimizer(model: nn.Module, hyper: Hyper) -> torch.optim.AdamW:
    return adamw(param_groups(model, hyper), hyper)


class Batches:
    """Random training windows; the stream depends on (seed, host, start) and, for a host's
    second and later trainers, on `trainer`."""

    def __init__(self, batch: int, seq_len: int, seed: int = 0, host: int = 0,
                 start: int = 0, trainer: int = 0) -> None:
        self.data = load_corpus().train
        self.batch, self.seq_len = batch, seq_len
        self.rng = np.random.default_rng([seed, host, start] + ([trainer] if trainer else []))
        self.span = np.arange(seq_len + 1)

    def next(self) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch)
        return torch.from_numpy(self.data[starts[:, None] + self.span].astype(np.int64))


def validation_windows(name: str = "small") -> torch.Tensor:
    """The fixed validation windows (VAL_WINDOWS x context+1) for a preset."""
    cfg = model_config(name)
    data = load_corpus().validation
    rng = np.random.default_rng(VAL_SEED)
    starts = np.sort(rng.choice(len(data) - cfg.context - 1, size=VAL_WINDOWS, replace=False))
    return torch.from_numpy(data[starts[:, None] + np.arange(cfg.context + 1)].astype(np.int64))


def held_out_windows(data: np.ndarray, context: int, count: int = HELD_OUT_WINDOWS,
                     seed: int = HELD_OUT_SEED) -> np.ndarray:
    """`count` disjoint windows of context+1 bytes of `data` (count x context+1, uint8): the
    data cut into consecutive tiles, `count` of them drawn by a generator of its own, in
    order. Each window scores `context` bytes, so the set scores count x context distinct
    bytes; the same for every row of every run."""
    width = context + 1
    tiles = len(data) // width
    if count > tiles:
        raise ValueError(f"{len(data):,} bytes hold {tiles} windows of {width}, not {count}")
    chosen = np.sort(np.random.default_rng(seed).choice(tiles, size=count, replace=False))
    return data[chosen[:, None] * width + np.arange(width)]


def held_out_set(name: str = "small", count: int = HELD_OUT_WINDOWS) -> torch.Tensor:
    """The held-out windows of the validation files for a preset (int64 tensor)."""
    cfg = model_config(name)
    windows = held_out_windows(load_corpus().validation, cfg.context, count)
    return torch.from_numpy(windows.astype(np.int64))


def evaluate(state_dict: Mapping[str, torch.Tensor], model: str = "small",
             windows: torch.Tensor | None = None) -> float:
    """Mean loss (nats per byte) of a state_dict of the preset `model` over `windows`
    (default: the validation windows), EVAL_CHUNK windows per forward pass."""
    net = ByteLM(model_config(model))
    net.load_state_dict(dict(state_dict))
    net.eval()
    data = validation_windows(model) if windows is None else windows
    total = 0.0
    with torch.no_grad():
        for chunk in torch.split(data, EVAL_CHUNK):
            total += float(lm_loss(net, chunk)) * len(chunk)
    return total / len(data)


def mean_state(states: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of state_dicts of one model (its floating tensors; others are
    taken from the first): an exact average of the hosts' models."""
    if not states:
        raise ValueError("no state to average")
    out = {}
    for name, first in states[0].items():
        if torch.is_floating_point(first):
            out[name] = torch.stack([s[name].double() for s in states]).mean(0).to(first.dtype)
        else:
            out[name] = first.clone()
    return out


def train_entropy() -> float:
    """The byte unigram entropy (nats) of the training text."""
    return unigram_entropy(load_corpus().train)


def check_seq_len(model: str, seq_len: int) -> None:
    """Validation scores every position of the context: training must cover them all."""
    context = model_config(model).context
    if seq_len != context:
        raise ValueError(f"seq_len {seq_len} must equal the {model} model's context {context}: "
                         "validation scores every position, so training must train them all")


def _alone(args: argparse.Namespace) -> int:
    """Trains one process alone; the clock counts training only, not the evaluations."""
    torch.set_num_threads(args.threads)
    hyper = Hyper(args.batch, args.seq_len, args.lr, args.weight_decay)
    check_seq_len(args.model, hyper.seq_len)
    model = build_model(args.model, seed=0)
    opt = make_optimizer(model, hyper)
    batches = Batches(hyper.batch, hyper.seq_len, seed=0)
    entropy = train_entropy()
    corpus = load_corpus()
    print(f"corpus {corpus.root}: {len(corpus.train):,} training bytes "
          f"({len(corpus.train_files)} files), {len(corpus.validation):,} validation bytes "
          f"({len(corpus.validation_files)} files)")
    print(f"model {args.model}: {count_parameters(model):,} parameters; batch {hyper.batch} x "
          f"{hyper.seq_len} bytes, AdamW lr {hyper.lr} wd {hyper.weight_decay}, "
          f"{args.threads} thread(s)")
    print(f"byte unigram entropy of the training text: {entropy:.4f} nats "
          f"({entropy / math.log(2):.3f} bits); 30 % below it is {0.7 * entropy:.4f} nats")
    print(f"{'train s':>8} {'step':>6} {'val loss':>9} {'below':>7} {'train loss':>10}")
    loss0 = evaluate(model.state_dict(), args.model)
    print(f"{0.0:8.1f} {0:6d} {loss0:9.4f} {100 * (1 - loss0 / entropy):6.1f}%", flush=True)
    budget, trained, step, next_eval = args.minutes * 60.0, 0.0, 0, args.eval_every
    step_times: list[float] = []
    loss, train_losses = loss0, []
    reached: tuple[int, float] | None = None  # (step, training seconds) first 30 % below
    max_steps = args.steps or sys.maxsize
    while trained < budget and step < max_steps:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        train_loss = lm_loss(model, batches.next())
        train_loss.backward()
        train_losses.append(float(train_loss.detach()))
        opt.step()
        dt = time.perf_counter() - t0
        trained += dt
        step_times.append(dt)
        step += 1
        at_end = trained >= budget or step >= max_steps
        if (args.steps and step % args.eval_steps == 0) or (not args.steps and (
                trained >= next_eval)) or at_end:
            next_eval += args.eval_every
            loss = evaluate(model.state_dict(), args.model)
            if reached is None and loss <= 0.7 * entropy:
                reached = (step, trained)
            print(f"{trained:8.1f} {step:6d} {loss:9.4f} {100 * (1 - loss / entropy):6.1f}% "
                  f"{statistics.fmean(train_losses):10.4f}", flush=True)
            train_losses = []
    t0 = time.perf_counter()
    evaluate(model.state_dict(), args.model)
    eval_s = time.perf_counter() - t0
    below = 100 * (1 - loss / entropy)
    print(f"after {trained / 60:.1f} min ({step} steps, median step "
          f"{1000 * statistics.median(step_times):.0f} ms, fastest "
          f"{1000 * min(step_times):.0f} ms, evaluate {1000 * eval_s:.0f} ms): "
          f"val loss {loss:.4f} nats, {below:.1f} % below the unigram entropy "
          f"({'meets' if below >= 30 else 'MISSES'} the 30 % check)")
    if reached is not None:
        print(f"first 30 % below at step {reached[0]} after {reached[1] / 60:.1f} min of "
              f"training ({reached[0] * min(step_times) / 60:.1f} min at the fastest step's pace)")
    return 0 if below >= 30 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alone", action="store_true", help="train one process alone")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=DEFAULT_HYPER.batch)
    p.add_argument("--seq-len", type=int, default=DEFAULT_HYPER.seq_len)
    p.add_argument("--lr", type=float, default=DEFAULT_HYPER.lr)
    p.add_argument("--weight-decay", type=float, default=DEFAULT_HYPER.weight_decay)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=float, default=20.0, help="training seconds")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps too")
    p.add_argument("--eval-steps", type=int, default=100,
                   help="with --steps: evaluate every this many steps")
    args = p.parse_args(argv)
    if not args.alone:
        corpus = load_corpus()
        print(f"corpus {corpus.root}; unigram entropy {train_entropy():.4f} nats; "
              + ", ".join(f"{n}: {count_parameters(build_model(n)):,} parameters"
                          for n in PRESETS))
        return 0
    return _alone(args)


if __name__ == "__main__":
    sys.exit(main())
