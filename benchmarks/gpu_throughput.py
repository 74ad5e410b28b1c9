"""Training throughput and peak memory: fp32, native autocast, ampkit O1, ampkit O2.

Two models, each trained a few steps per mode, side by side in one process:

* ``gpt``: a GPT-2-small-size decoder (vocab 50257, 12 layers, d=768, 12 heads, 1024
  positions, tied output head; 124M parameters) on random tokens: tokens per second;
* ``resnet``: a ResNet-18-style CNN (basic blocks [2, 2, 2, 2], widths 64-512,
  BatchNorm) on random 224x224 images, 1000 classes: images per second.

Modes (every one starts from the same initial weights):

* ``fp32``: plain fp32 training (TF32 matmuls off, so this is true fp32);
* ``native``: ``torch.autocast`` around the forward, ``torch.amp.GradScaler`` for fp16;
* ``ampkit-O1``: ``ampkit.initialize(level="O1")`` (the forward runs in
  ``ampkit.autocast`` with the default policy), ``ampkit.scale_loss`` for fp16;
* ``ampkit-O2``: ``ampkit.initialize(level="O2")``: low-precision parameters with fp32
  master weights, norms in fp32, ``ampkit.scale_loss`` for fp16.

Each mode runs ``--warmup`` steps, then ``--steps`` timed steps (forward, backward,
optimizer step, AdamW), synchronising the device around the timed region. Peak memory
is the device allocator's peak during the timed steps (``torch.cuda.max_memory_allocated``
on CUDA; on CPU, tensor allocations recorded by the profiler, plus what was already
allocated).

Needs a CUDA device; without one it says so and exits with status 1. ``--device cpu
--tiny`` runs tiny versions of both models on CPU as a smoke test of the script itself
(its speeds mean nothing: bf16 matmuls on AVX2 CPUs are emulated).

Run: ``python benchmarks/gpu_throughput.py [--dtype bfloat16|float16] [--models gpt resnet]``
     ``python benchmarks/gpu_throughput.py --device cpu --tiny``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

MODES = ("fp32", "native", "ampkit-O1", "ampkit-O2")


# -- models ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    dim: int = 768
    heads: int = 12
    layers: int = 12
    max_len: int = 1024


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-style decoder: token + learned position embeddings, pre-norm blocks, final
    LayerNorm, output head tied to the token embedding. Takes token ids, returns logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.Sequential(*(GPTBlock(cfg) for _ in range(cfg.layers)))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02), zero biases
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        return self.head(self.ln_f(self.blocks(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18-style: stem, four stages of basic blocks, global pool, classifier."""

    def __init__(self, widths: tuple[int, ...] = (64, 128, 256, 512),
                 blocks: tuple[int, ...] = (2, 2, 2, 2), classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], widths[0]
        for i, (width, count) in enumerate(zip(widths, blocks)):
            for j in range(count):
                layers.append(BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    unit: str  # what throughput counts: tokens or images
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    items_per_batch: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def workloads(tiny: bool, batch: int | None, seq: int | None) -> dict[str, Workload]:
    gpt_cfg = GPTConfig(vocab=512, dim=64, heads=2, layers=2, max_len=64) if tiny else GPTConfig()
    gpt_batch, gpt_seq = (batch or 2, seq or 32) if tiny else (batch or 8, seq or 1024)
    res_batch, res_size = (batch or 4, 32) if tiny else (batch or 64, 224)
    res_kwargs: dict[str, Any] = (dict(widths=(8, 16), blocks=(1, 1), classes=10) if tiny
                                  else {})
    classes = res_kwargs.get("classes", 1000)

    def gpt_batch_fn(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, gpt_cfg.vocab, (gpt_batch, gpt_seq + 1), device=device)
        return ids[:, :-1], ids[:, 1:]

    def res_batch_fn(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(res_batch, 3, res_size, res_size, device=device),
                torch.randint(0, classes, (res_batch,), device=device))

    return {
        "gpt": Workload("gpt", "tokens", lambda: GPT(gpt_cfg), gpt_batch_fn,
                        gpt_batch * gpt_seq, _lm_loss),
        "resnet": Workload("resnet", "images", lambda: ResNet(**res_kwargs), res_batch_fn,
                           res_batch, lambda out, y: F.cross_entropy(out.float(), y)),
    }


# -- peak memory ----------------------------------------------------------------------------

def _storage_bytes(tensors: Iterator[torch.Tensor], device_type: str = "cpu") -> int:
    """Bytes of the distinct storages behind ``tensors`` on devices of ``device_type``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device_type and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def live_training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer
                          ) -> Iterator[torch.Tensor]:
    """Every tensor a training run keeps between steps: parameters, their gradients,
    buffers, the optimizer's parameters (fp32 masters) and state."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def peak_memory(device: torch.device, already_allocated: int) -> Iterator[dict[str, int]]:
    """Measure the peak bytes allocated on ``device`` inside the block: ``result["peak"]``.

    CUDA: the caching allocator's own peak counter. CPU: the profiler records every
    tensor allocation and free; the peak of their running sum, plus the bytes already
    allocated when the block starts (``already_allocated``), is the peak. (The
    profiler slows the CPU down: never time a block measured this way.)
    """
    result: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device)
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    running = highest = 0
    for _, nbytes in changes:
        running += nbytes
        highest = max(highest, running)
    result["peak"] = already_allocated + highest


# -- one mode -------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    workload: str
    mode: str
    items_per_s: float
    peak_bytes: int
    final_loss: float


def _setup(mode: str, model: nn.Module, dtype: torch.dtype, device: torch.device
           ) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Any], Any]:
    """The model, optimizer, forward region and scaler for one mode."""
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    region: Callable[[], Any] = contextlib.nullcontext
    scaler = None
    if mode == "native":
        region = lambda: torch.autocast(device.type, dtype)  # noqa: E731
        if dtype is torch.float16:
            scaler = torch.amp.GradScaler(device.type)
    elif mode.startswith("ampkit-"):
        model, optimizer = ampkit.initialize(model, optimizer, level=mode.split("-")[1],
                                             dtype=dtype)
    return model, optimizer, region, scaler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, region: Callable[[], Any],
               scaler: Any, mode: str, dtype: torch.dtype, work: Workload,
               batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    with region():
        out = model(inputs)
    loss = work.loss(out, targets)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    elif mode.startswith("ampkit-") and dtype is torch.float16:
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def profile_step(step: Callable[[], Any], device: torch.device, top: int) -> str:
    """The ``top`` ops of one training step by self time on ``device`` (CUDA kernels'
    time on a GPU, CPU time otherwise), as the profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=top)


def run_mode(work: Workload, mode: str, base: nn.Module, dtype: torch.dtype,
             device: torch.device, warmup: int, steps: int, profile_top: int = 0
             ) -> Result:
    torch.manual_seed(0)
    model = copy.deepcopy(base).to(device)
    model, optimizer, region, scaler = _setup(mode, model, dtype, device)
    batches = [work.make_batch(device) for _ in range(warmup + steps + 1)]
    loss = torch.zeros(())
    for batch in batches[:warmup]:
        loss = train_step(model, optimizer, region, scaler, mode, dtype, work, batch)

    # Timed steps: on CUDA the allocator's peak counter costs nothing, so they are also
    # the measured ones; on CPU the profiler would distort the timing, so one more step
    # is measured afterwards.
    measure = peak_memory(device, 0) if device.type == "cuda" else contextlib.nullcontext({})
    with measure as memory:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for batch in batches[warmup:warmup + steps]:
            loss = train_step(model, optimizer, region, scaler, mode, dtype, work, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    if device.type != "cuda":
        allocated = _storage_bytes(live_training_tensors(model, optimizer))
        with peak_memory(device, allocated) as memory:
            train_step(model, optimizer, region, scaler, mode, dtype, work, batches[-1])
    if profile_top:
        one_step = functools.partial(train_step, model, optimizer, region, scaler, mode, dtype,
                                     work, batches[-1])
        table = profile_step(one_step, device, profile_top)
        print(f"\n{work.name} {mode}, one step profiled:\n{table}", flush=True)
    final = loss.item()
    if not math.isfinite(final):
        raise RuntimeError(f"{work.name} {mode}: the loss is {final}")
    del model, optimizer, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Result(work.name, mode, steps * work.items_per_batch / elapsed, memory["peak"],
                  final)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"],
                        choices=["gpt", "resnet"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None, help="GPT sequence length")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="default 10 (tiny: 3)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="after each mode's timed steps, profile one more step and "
                             "print its TOP ops by self time (default: no profile)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here, nothing was measured. Run it on a "
              "machine with a GPU, or smoke-test the script with --device cpu --tiny.",
              file=sys.stderr)
        return 1
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.steps = args.steps if args.steps is not None else (3 if args.tiny else 10)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        # fp32 means fp32: no TF32 tensor-core matmuls in the baseline.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    print(f"device: {_device_name(device)}; torch {torch.__version__}; dtype {args.dtype}; "
          f"{args.steps} timed steps after {args.warmup} warm-up steps"
          + ("; TINY smoke models (speeds meaningless)" if args.tiny else ""))
    results: list[Result] = []
    for name in args.models:
        work = workloads(args.tiny, args.batch, args.seq)[name]
        torch.manual_seed(0)
        base = work.make_model()
        params = sum(p.numel() for p in base.parameters())
        print(f"\n{name}: {params / 1e6:.1f}M parameters, {work.items_per_batch} {work.unit} "
              f"per step")
        print(f"| mode | {work.unit}/s | vs {args.modes[0]} | vs native | peak memory | "
              f"vs {args.modes[0]} | final loss |")
        print("|---|---|---|---|---|---|---|")
        first: Result | None = None
        native: Result | None = None
        for mode in args.modes:
            result = run_mode(work, mode, base, dtype, device, args.warmup, args.steps,
                              args.profile)
            results.append(result)
            first = first or result
            native = result if mode == "native" else native
            vs_native = (f"{result.items_per_s / native.items_per_s:.2f}x" if native
                         else "-")
            print(f"| {mode} | {result.items_per_s:,.0f} | "
                  f"{result.items_per_s / first.items_per_s:.2f}x | {vs_native} | "
                  f"{result.peak_bytes / 2 ** 20:,.1f} MiB | "
                  f"{result.peak_bytes / first.peak_bytes:.2f}x | {result.final_loss:.4f} |",
                  flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": _device_name(device), "torch": torch.__version__,
                       "dtype": args.dtype, "tiny": args.tiny,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
