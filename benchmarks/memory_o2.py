"""Peak memory of one training step: ampkit O2 (and O1, O3, native autocast) vs fp32.

A GPT-style decoder (the one in ``_training.py``, tied head, 4 heads) trained with
AdamW on random tokens, in three small sizes (``--preset``):

* ``deep``: d=128, 8 layers, vocab 512, batch 16 x 256 tokens (activations dominate);
* ``wide``: d=256, 4 layers, vocab 512, batch 8 x 256 (4x the parameters per layer);
* ``big-vocab``: d=128, 4 layers, vocab 2048, batch 16 x 256 (the fp32 logits and loss,
  which every mixed-precision mode keeps in fp32, weigh more);
* ``gpt-1024``: d=1024, 8 layers, vocab 512, batch 8 x 1024 (issue 10's GPU transformer;
  named only, not part of ``all``: on a CPU without native bf16 it takes hours);
* ``toy``: d=64, 2 layers, vocab 256, batch 2 x 32: a rehearsal of the script only.

Each configuration starts from the same weights, takes two warm-up steps (so the
optimizer state exists, as in any step of a real run), then one measured step:
forward, backward, ``optimizer.step()``, ``zero_grad``.

Peak = bytes held between steps (parameters, optimizer state, buffers)
+ the highest point of the tensor allocations made during the step, as recorded by the
PyTorch profiler (``profile_memory=True``); on CUDA the allocator's peak counter.
Everything is measured in this one process, one configuration after the other.

Target (issue 3): O2 <= 0.6x fp32. What O2 cannot save: the fp32 parameters and
optimizer state, fp32 training's 12 bytes per parameter between steps (since issue 21
the fp32 parameters are the truth and O2 holds nothing else; with fp32 masters it held
14), and the fp32 loss path. Kept-fp32 norms cost no extra activation memory: autograd keeps
their low-precision input, not its fp32 copy (see ``ampkit.conversion``).

Configurations: ``fp32``; ``native`` (an fp32 model under ``torch.autocast``, and
``torch.amp.GradScaler`` for float16); ``O1``, ``O2``, ``O3`` (``ampkit.initialize``).

Run: ``python benchmarks/memory_o2.py [--preset all|deep|wide|big-vocab|gpt-1024|toy ...]
[--device cpu|cuda] [--dtype bfloat16|float16] [--heads 4]``
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _training import (
    GPT,
    GPTConfig,
    Workload,
    _device_name,
    _lm_loss,
    _setup,
    _storage_bytes,
    live_training_tensors,
    peak_memory,
    train_step,
)

CONFIGS = ("fp32", "native", "O1", "O2", "O3")
PRESETS = {  # name: (dim, layers, vocab, batch, seq)
    "deep": (128, 8, 512, 16, 256),
    "wide": (256, 4, 512, 8, 256),
    "big-vocab": (128, 4, 2048, 16, 256),
    # Issue 10's GPU transformer (its vocabulary was not stated): for --device cuda.
    "gpt-1024": (1024, 8, 512, 8, 1024),
    # A rehearsal size (gpu_checks.sh --rehearse): seconds on a CPU, numbers meaningless.
    "toy": (64, 2, 256, 2, 32),
}
ALL = ("deep", "wide", "big-vocab")  # --preset all: the ones a CPU runs in minutes


def measure(config: str, base: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype,
            device: torch.device) -> tuple[int, int]:
    """``(bytes held between steps, peak bytes of one step)``."""
    # The training step of gpu_throughput.py: fused AdamW on CUDA (foreach on the CPU),
    # GradScaler for native fp16, ampkit.scale_loss for the ampkit levels in fp16.
    mode = config if config in ("fp32", "native") else f"ampkit-{config}"
    model, optimizer, region, scaler = _setup(mode, copy.deepcopy(base).to(device), dtype,
                                              device)
    work = Workload("gpt", "tokens", lambda: base, lambda _: (ids[:, :-1], ids[:, 1:]),
                    ids[:, 1:].numel(), _lm_loss)
    batch = work.make_batch(device)

    def step() -> None:
        train_step(model, optimizer, region, scaler, mode, dtype, work, batch)

    for _ in range(2):
        step()
    held = _storage_bytes(live_training_tensors(model, optimizer), device.type)
    with peak_memory(device, held) as memory:
        step()
    return held, memory["peak"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--preset", nargs="+", default=["all"], choices=["all", *PRESETS],
                        help="one or more presets; all: " + ", ".join(ALL))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("memory_o2: no CUDA device here; use --device cpu", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"device: {_device_name(device)}; torch {torch.__version__}; {args.dtype}; AdamW")
    presets = [p for given in args.preset for p in (ALL if given == "all" else [given])]
    for preset in dict.fromkeys(presets):
        dim, layers, vocab, batch, seq = PRESETS[preset]
        torch.manual_seed(0)
        base = GPT(GPTConfig(vocab=vocab, dim=dim, heads=args.heads, layers=layers,
                             max_len=seq))
        ids = torch.randint(0, vocab, (batch, seq + 1), device=device)
        params = sum(p.numel() for p in base.parameters())
        print(f"\n{preset}: d={dim}, {layers} layers, vocab {vocab}, {params / 1e6:.2f}M "
              f"parameters, batch {batch} x {seq} tokens")
        print("| config | held between steps | peak of one step | vs fp32 |")
        print("|---|---|---|---|")
        baseline = None
        for config in CONFIGS:
            held, peak = measure(config, base, ids, dtype, device)
            baseline = baseline or peak
            print(f"| {config} | {held / 2 ** 20:.1f} MiB | {peak / 2 ** 20:.1f} MiB | "
                  f"{peak / baseline:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
