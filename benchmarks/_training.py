"""The small models, training step and memory measurement the CPU benchmarks share.

* ``GPT``: a GPT-2-style decoder (token and learned position embeddings, pre-norm blocks,
  tied output head; ``GPTConfig()`` is GPT-2 small's size);
* ``ResNet``: a ResNet-18-style CNN (basic blocks, BatchNorm);
* ``_setup`` / ``train_step``: one training step in the modes ``fp32``, ``native``
  (``torch.autocast``, ``GradScaler`` for float16), ``ampkit-O1``/``-O2``/``-O3``;
* ``peak_memory``: the peak bytes of a block (the CUDA allocator's counter, or on the
  CPU the profiler's allocation record).

``memory_o2.py``, ``memory_pure.py`` and ``cast_traffic.py`` use them; the GPU
throughput table (``gpu_throughput.py``) has its own models, in ``_gpu_models.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

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


# -- peak memory ----------------------------------------------------------------------------

def _storage_bytes(tensors: Iterator[torch.Tensor], device_type: str = "cpu") -> int:
    """Bytes of the distinct storages behind ``tensors`` on devices of ``device_type``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device_type and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def live_training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer,
                          scratch: bool = True) -> Iterator[torch.Tensor]:
    """Every tensor a training run keeps between steps: parameters, their gradients,
    buffers, the optimizer's parameters (fp32 masters) and state, and (``scratch``) a
    pure optimizer's kept scratch."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    kept = getattr(optimizer, "kept_scratch", None)
    if scratch and kept is not None:
        yield from kept()


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


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
