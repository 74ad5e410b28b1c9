"""fp32, bf16 O2 and fp8 O2 side by side on a transformer block (issue 27).

The model: an input projection, ``--layers`` pre-norm transformer blocks (LayerNorm,
one Linear for q/k/v, ``scaled_dot_product_attention``, an output Linear, LayerNorm,
an MLP of two Linears with GELU) and a head. It learns to imitate a fixed random
teacher of the same shape (MSE), with AdamW, from the same initial weights and the
same batches in every configuration:

* ``fp32``: no ampkit;
* ``bf16 O2``: ``ampkit.initialize(level="O2", dtype=torch.bfloat16)``;
* ``fp8 O2 <recipe>``: the same with ``fp8=<recipe>``: the blocks' Linears in fp8 (the
  input projection and the head are the first and last Linear, kept out by default).

Printed per configuration: the loss after ``--steps`` steps (mean of the last 10),
the median step time (forward, backward, optimizer) over the steps after
``--warmup``, and memory: on CUDA the peak allocated during a step; everywhere the
bytes autograd saves for the backward in one step (activations; torchao's Float8Linear
saves its high-precision input and weight and re-casts in the backward). On CPU the
times say nothing about fp8 speed (``torch._scaled_mm`` on CPU is a reference kernel);
the losses are the numerics. ``--compile`` compiles each block (as torchtitan does;
with graph breaks at the kept-fp32 norms' boundaries).

Run: ``python benchmarks/fp8.py [--device cpu] [--steps 200] [--dim 128] [--compile]``;
the GPU shape: ``--device cuda --dim 2048 --seq 2048 --batch 4 --layers 2 --compile``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

# its sibling scripts, when run from anywhere or loaded by path (the suite does)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import fp8_unavailable

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def build(dim: int, heads: int, layers: int, seed: int, device: str) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, dim), *[Block(dim, heads) for _ in range(layers)],
                         nn.LayerNorm(dim), nn.Linear(dim, dim)).to(device)


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for the backward during ``step``."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        inner = getattr(t, "_data", t)  # torchao's fp8 tensors: count their payload
        try:
            storage = inner.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def run(name: str, base: nn.Module, teacher: nn.Module, args: argparse.Namespace,
        fp8: str | None) -> dict[str, float]:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if name != "fp32":
        model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
                                       fp8=fp8)
    if args.compile:
        for module in model:
            if isinstance(module, Block):
                # not fullgraph: the kept-fp32 LayerNorms' boundary regions break the
                # graph (an O2 limit, README "Known limits"); Linears alone trace whole
                module.compile()
    gen = torch.Generator(args.device).manual_seed(1)
    cuda = args.device.startswith("cuda")
    losses, times, peak = [], [], 0

    def batch() -> torch.Tensor:
        return torch.randn(args.batch, args.seq, args.dim, generator=gen, device=args.device)

    for _ in range(args.steps):
        x = batch()
        with torch.no_grad():
            target = teacher(x)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    x = batch()
    saved = saved_bytes(lambda: model(x).float().pow(2).mean().backward())
    timed = times[args.warmup:] or times
    return {"loss": statistics.fmean(losses[-10:]), "first": losses[0],
            "ms": 1e3 * statistics.median(timed), "saved": saved, "peak": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"{platform.machine()} CPU, {args.threads} thread(s)")
    # A recipe this machine cannot run (no torchao, no fp8 GPU, a CPU _scaled_mm without
    # per-row scales) is left out with its reason printed: never silently.
    unavailable = {r: fp8_unavailable(r, torch.device(args.device)) for r in args.recipes}
    for recipe, reason in unavailable.items():
        if reason is not None:
            print(f"fp8 O2 {recipe}: skipped: {reason}")
    recipes = [r for r in args.recipes if unavailable[r] is None]
    if not recipes:
        print("fp8: no recipe can run here, nothing was measured")
        return 0
    import torchao

    print(f"machine: {where}; torch {torch.__version__}, torchao {torchao.__version__}")
    print(f"{args.layers} transformer block(s), dim {args.dim}, seq {args.seq}, batch "
          f"{args.batch}, {args.steps} AdamW steps (lr {args.lr})"
          f"{', blocks compiled' if args.compile else ''}")
    base = build(args.dim, args.heads, args.layers, 0, args.device)
    teacher = build(args.dim, args.heads, args.layers, 1, args.device).requires_grad_(False)
    configs = [("fp32", None), ("bf16 O2", None)] + [(f"fp8 O2 {r}", r) for r in recipes]
    results = {name: run(name, base, teacher, args, fp8) for name, fp8 in configs}
    bf16 = results["bf16 O2"]
    print("\n| configuration | loss (first) | loss after steps | vs bf16 O2 | step ms "
          "| vs bf16 O2 | saved for backward | peak CUDA memory |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        peak = f"{r['peak'] / 2**20:.1f} MiB" if r["peak"] else "-"
        print(f"| {name} | {r['first']:.4f} | {r['loss']:.5f} | "
              f"{r['loss'] / bf16['loss']:.2f}x | {r['ms']:.2f} | "
              f"{bf16['ms'] / r['ms']:.2f}x speed | {r['saved'] / 2**20:.2f} MiB | {peak} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
