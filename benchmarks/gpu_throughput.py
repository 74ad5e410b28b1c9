"""Training throughput and peak memory of every precision mode, side by side, on a GPU.

Three models (``_gpu_models.py``): a ResNet-50-sized CNN with BatchNorm (images/s), a
GPT-2-small decoder and a two-block Llama-2-7B-width stack at sequence length 2,048
(tokens/s). Modes, each from the same initial weights and on the same batches, AdamW
(fused) at lr 1e-4:

* ``fp32``: no autocast, TF32 off (true fp32);
* ``native-bf16``, ``native-fp16``: ``torch.autocast`` around the forward (and
  ``torch.amp.GradScaler`` for fp16); ``native-bf16`` is the baseline of every ratio;
* ``O1``: ``ampkit.initialize(level="O1")``, bfloat16;
* ``O1+5``: O1 with five custom white-list entries that native CUDA autocast already
  casts (linear, matmul, bmm, baddbmm, addmm): the same computation, so the difference
  to ``O1`` is the dispatcher kernels' interception alone;
* ``O2``: ``level="O2"`` (fp32 parameters, cast on use);
* ``pure-stochastic``, ``pure-kahan``: pure bfloat16 training
  (``master_weights="stochastic"`` / ``"kahan"``);
* ``pure-in-backward``: ``pure-stochastic`` with ``step_in_backward=True`` (each
  parameter steps inside backward as its gradient is ready; no ``optimizer.step()``);
* ``pure-stochastic-compiled-step``, ``pure-kahan-compiled-step``: the two pure modes
  with ``compile_step=True`` (the optimizer step's update and rounding compiled by
  ``torch.compile`` with inductor, in both phases; the model is compiled only in the
  compiled phase). Their first step compiles the step's few graphs, once per rounding
  and process (about the graphs: :mod:`ampkit.pure.compiled_step`); a mode whose
  optimizer fell back to the eager step is printed as skipped, with the warning's
  reason, rather than timed under a name it did not earn. They come last in the eager
  phase, so that a spent ``--budget`` leaves them out rather than the cheap modes;
* ``fp8-tensorwise``, ``fp8-rowwise``: O2 with ``fp8=<recipe>`` (torchao). Skipped, with
  the reason printed, where torchao does not import, where the GPU has no fp8 tensor
  cores (compute capability below 8.9), and on the CNN (its only Linear is its head,
  which fp8 keeps out).

Each mode runs eager and under ``torch.compile`` (default inductor; the transformers'
decoder layers compiled one by one, as torchtitan does, so that one compile serves
every layer; the CNN compiled whole). The modes of one model and phase are all built
first, then timed in interleaved rounds (each mode ``--steps`` steps per round, the
modes in turn), so machine noise hits them alike; the median round gives the speed.
Warm-up steps (compilation included; one more step when compiled) are not timed; each
table is followed by every mode's warm-up time (its compilations).
Timing: CUDA events on a GPU, ``time.perf_counter`` on the CPU. Peak memory (CUDA
only): the allocator's peak during a mode's timed steps, less what the other modes
hold, plus what the mode holds itself.

Time (H100, an estimate, not measured: no GPU was lent to the session that wrote it):
the eager phase is about 10 s per model (the slowest steps are fp32's, ~0.2 s); the
compiled phase is dominated by compilation, ~5-15 s per mode for the transformers
(one layer compiled) and ~30 s per mode for the CNN, ~5 min for the table. ``--budget``
bounds the run: a mode not started when it is spent is printed as not run, with why.
The compiled phase takes the models in the order llama, gpt2, resnet50, each with an
equal share of the budget left, and the modes in ``COMPILE_PRIORITY``'s order.

``--rehearse`` runs the same code at toy sizes on the CPU (compile backend
``aot_eager`` by default, which traces forward and backward as inductor would but
emits no code): a rehearsal of the GPU run, its speeds meaningless. ``--compile-modes``
narrows the compiled phase (``gpu_checks.sh --rehearse`` uses it to stay short).

Run: ``python benchmarks/gpu_throughput.py [--models resnet50 gpt2 llama] [--modes ...]
[--compile off|on|both] [--budget 300] [--profile 15]``; ``--rehearse`` on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpu_models import MODELS, Workload, loss_of, repeated_blocks, workload
from _training import _storage_bytes, live_training_tensors

import ampkit
from ampkit.pure.compiled_step import CompiledStepFallbackWarning
from ampkit.step_in_backward import steps_in_backward

#: Five custom entries native CUDA autocast already runs in the low precision.
FIVE_SAME = ["linear", "matmul", "bmm", "baddbmm", "addmm"]
BF16, FP16 = torch.bfloat16, torch.float16


@dataclasses.dataclass(frozen=True)
class Mode:
    autocast: torch.dtype | None = None  # native torch.autocast's dtype
    initialize: dict[str, Any] | None = None  # ampkit.initialize's keywords

    @property
    def fp8(self) -> str | None:
        return (self.initialize or {}).get("fp8")

    @property
    def compile_step(self) -> bool:
        return bool((self.initialize or {}).get("compile_step"))


MODES: dict[str, Mode] = {
    "fp32": Mode(),
    "native-bf16": Mode(autocast=BF16),
    "native-fp16": Mode(autocast=FP16),
    "O1": Mode(initialize={"level": "O1"}),
    "O1+5": Mode(initialize={"level": "O1", "custom_white_list": FIVE_SAME}),
    "O2": Mode(initialize={"level": "O2"}),
    "pure-stochastic": Mode(initialize={"level": "O2", "master_weights": "stochastic"}),
    "pure-kahan": Mode(initialize={"level": "O2", "master_weights": "kahan"}),
    "pure-in-backward": Mode(initialize={"level": "O2", "master_weights": "stochastic",
                                         "step_in_backward": True}),
    "fp8-tensorwise": Mode(initialize={"level": "O2", "fp8": "tensorwise"}),
    "fp8-rowwise": Mode(initialize={"level": "O2", "fp8": "rowwise"}),
    # Last: their first step compiles the step's graphs (once per rounding and process).
    "pure-stochastic-compiled-step": Mode(initialize={"level": "O2",
                                                      "master_weights": "stochastic",
                                                      "compile_step": True}),
    "pure-kahan-compiled-step": Mode(initialize={"level": "O2", "master_weights": "kahan",
                                                 "compile_step": True}),
}
BASELINE = "native-bf16"
#: The order in which compiled models and modes are built, so that a spent --budget
#: leaves out the least needed: the baseline and the modes the targets name first.
COMPILE_MODEL_PRIORITY = ("llama", "gpt2", "resnet50")
COMPILE_PRIORITY = ("native-bf16", "O2", "O1+5", "fp8-tensorwise", "O1", "pure-stochastic",
                    "pure-stochastic-compiled-step", "pure-kahan",
                    "pure-kahan-compiled-step", "pure-in-backward", "fp8-rowwise",
                    "native-fp16", "fp32")


def device_header(device: torch.device) -> str:
    """The device, torch and CUDA versions, in one line."""
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    return f"device: {where}; torch {torch.__version__}; CUDA {torch.version.cuda}"


def fp8_unavailable(recipe: str, device: torch.device) -> str | None:
    """Why fp8 cannot run here, or None."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (carry its wheel, see gpu_checks.sh)"
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # an import failure of any kind is the reason to report
        return f"torchao does not import here: {type(error).__name__}: {error}"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return (f"fp8 needs compute capability 8.9 or newer; this GPU has "
                    f"{capability[0]}.{capability[1]}")
    elif recipe != "tensorwise":
        from ampkit.fp8.recipe import cpu_scaled_mm_takes_rowwise_scales

        if not cpu_scaled_mm_takes_rowwise_scales():
            return f"this torch's CPU torch._scaled_mm takes no per-row scales ({recipe})"
    return None


class CompiledStepFallbackError(Exception):
    """A ``compile_step`` mode's optimizer took the eager pure step (the warning's text)."""


class Clock:
    """Seconds between ``start()`` and ``stop()``: CUDA events on a GPU (the time the
    device spent, without a host sync in between), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, began: Any) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return began.elapsed_time(end) / 1e3
        return time.perf_counter() - began


@dataclasses.dataclass
class Run:
    """One mode of one model, built and warmed up, ready to be timed."""

    name: str
    work: Workload
    model: nn.Module
    optimizer: torch.optim.Optimizer
    forward: Callable[..., Any]
    autocast: torch.dtype | None
    scaler: torch.amp.GradScaler | None
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    seconds: list[float] = dataclasses.field(default_factory=list)
    warmup_seconds: float = 0.0
    peak: int = 0
    loss: float = math.nan
    _next: int = 0

    def step(self) -> torch.Tensor:
        inputs, targets = self.batches[self._next % len(self.batches)]
        self._next += 1
        region = (torch.autocast(inputs.device.type, self.autocast) if self.autocast
                  else contextlib.nullcontext())
        with region:
            out = self.work.forward(self.forward, inputs)
        loss = loss_of(out, targets)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()  # (pure-in-backward: every parameter steps in here)
            if not steps_in_backward(self.optimizer):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def held_bytes(self) -> int:
        """What this mode keeps between steps on its device."""
        device = self.batches[0][0].device.type
        return _storage_bytes(live_training_tensors(self.model, self.optimizer), device)


def build(name: str, work: Workload, base: nn.Module, device: torch.device, compiled: bool,
          backend: str, batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int
          ) -> Run:
    """Mode ``name`` on a copy of ``base``: converted, compiled if asked, warmed up."""
    mode = MODES[name]
    torch.manual_seed(0)
    model = copy.deepcopy(base).to(device)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                                         fused=True)
    if mode.initialize is not None:
        model, optimizer = ampkit.initialize(model, optimizer, dtype=BF16, **mode.initialize)
    forward: Callable[..., Any] = model
    if compiled:
        blocks = repeated_blocks(model)
        for block in blocks:  # regional: the layers share one compiled code
            block.compile(backend=backend)
        if not blocks:
            forward = torch.compile(model, backend=backend)
    scaler = torch.amp.GradScaler(device.type) if mode.autocast is FP16 else None
    run = Run(name, work, model, optimizer, forward, mode.autocast, scaler, batches)
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompiledStepFallbackWarning)
        # A compiled forward may compile again on its second call (a guard that only the
        # first step's state set up fails): one more untimed step keeps that out of the
        # times.
        for _ in range(warmup + compiled):
            run.loss = run.step().item()
    for warning in caught:
        if issubclass(warning.category, CompiledStepFallbackWarning):
            raise CompiledStepFallbackError(str(warning.message))
        warnings.showwarning(warning.message, warning.category, warning.filename,
                             warning.lineno)
    run.warmup_seconds = time.perf_counter() - began
    return run


def time_rounds(runs: list[Run], rounds: int, steps: int, device: torch.device) -> None:
    """Interleaved rounds: each run ``steps`` steps per round, the runs in turn."""
    clock = Clock(device)
    cuda = device.type == "cuda"
    for _ in range(rounds):
        for run in runs:
            if cuda:
                held = run.held_bytes()
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            began = clock.start()
            for _ in range(steps):
                loss = run.step()
            run.seconds.append(clock.stop(began) / steps)
            run.loss = loss.item()
            if cuda:
                during = torch.cuda.max_memory_allocated(device) - before
                run.peak = max(run.peak, during + held)


def profile_one_step(run: Run, device: torch.device, top: int) -> str:
    """The ``top`` ops of one more step of ``run`` by self time on the device (CUDA
    kernels' time on a GPU, CPU time on the CPU): the profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=sort_by, row_limit=top))


def print_table(work: Workload, phase: str, names: list[str], runs: dict[str, Run],
                skipped: dict[str, str], cuda: bool) -> list[dict[str, Any]]:
    """One markdown table for a model and phase; returns its rows as records."""
    base = runs.get(BASELINE)
    base_speed = (work.items / statistics.median(base.seconds)) if base else None
    print(f"\n{work.name}, {phase}: {work.shape} per step")
    print(f"| mode | {work.unit}/s | ms/step | vs {BASELINE} | peak memory | "
          f"vs {BASELINE} | loss |")
    print("|---|---|---|---|---|---|---|")
    records = []
    for name in names:
        if name in skipped:
            print(f"| {name} | skipped: {skipped[name]} | | | | | |")
            records.append({"model": work.name, "phase": phase, "mode": name,
                            "skipped": skipped[name]})
            continue
        run = runs[name]
        seconds = statistics.median(run.seconds)
        speed = work.items / seconds
        ratio = f"{speed / base_speed:.2f}x" if base_speed else "-"
        peak = f"{run.peak / 2 ** 20:,.0f} MiB" if cuda else "-"
        peak_ratio = f"{run.peak / base.peak:.2f}x" if cuda and base else "-"
        print(f"| {name} | {speed:,.0f} | {seconds * 1e3:.2f} | {ratio} | {peak} | "
              f"{peak_ratio} | {run.loss:.4f} |", flush=True)
        records.append({"model": work.name, "phase": phase, "mode": name,
                        "items_per_s": speed, "seconds_per_step": seconds,
                        "peak_bytes": run.peak if cuda else None, "loss": run.loss})
    return records


def run_phase(work: Workload, base: nn.Module, names: list[str], compiled: bool,
              args: argparse.Namespace, device: torch.device, deadline: float
              ) -> list[dict[str, Any]]:
    """Build every mode of one model and phase, time them interleaved, print the table."""
    phase = f"compiled ({args.backend})" if compiled else "eager"
    gen = torch.Generator(device).manual_seed(0)
    batches = [work.make_batch(device, gen) for _ in range(2)]
    order = ([n for n in COMPILE_PRIORITY if n in names] if compiled else names)
    runs: dict[str, Run] = {}
    skipped: dict[str, str] = {}
    for name in order:
        recipe = MODES[name].fp8
        reason = fp8_unavailable(recipe, device) if recipe else None
        if recipe and reason is None and work.unit == "images":
            reason = "its only Linear is the head, the last layer, which fp8 keeps out"
        if reason is None and time.monotonic() > deadline:
            reason = f"not run, the --budget of {args.budget:g} s was spent"
        if reason is not None:
            skipped[name] = reason
            continue
        try:
            runs[name] = build(name, work, base, device, compiled, args.backend, batches,
                               args.warmup)
        except CompiledStepFallbackError as error:
            skipped[name] = f"the compiled step fell back to the eager step: {error}"
        except torch.OutOfMemoryError:
            skipped[name] = "out of device memory with the other modes built"
            torch.cuda.empty_cache()
    live = [runs[n] for n in names if n in runs]
    time_rounds(live, args.rounds, args.steps, device)
    records = print_table(work, phase, names, runs, skipped, device.type == "cuda")
    if live:
        print("warm-up (compilation included): " + ", ".join(
            f"{run.name} {run.warmup_seconds:.1f} s" for run in live), flush=True)
    for record in records:
        if record["mode"] in runs:
            record["warmup_seconds"] = runs[record["mode"]].warmup_seconds
    for name in args.profile_modes if args.profile else ():
        if name in runs:
            print(f"\n{work.name} {name} ({phase}), one step profiled, top {args.profile} "
                  f"ops by self {'CUDA' if device.type == 'cuda' else 'CPU'} time:")
            print(profile_one_step(runs[name], device, args.profile), flush=True)
    for run in live:  # said at the end too, with the exit status: the table goes on
        if not math.isfinite(run.loss):
            print(f"{work.name} {run.name} ({phase}): the loss is {run.loss}", flush=True)
    runs.clear()
    live.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--compile", default="both", choices=["off", "on", "both"],
                        help="eager only, compiled only, or both (default)")
    parser.add_argument("--compile-modes", nargs="+", default=None, choices=list(MODES),
                        help="the modes of the compiled phase (default: --modes)")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; rehearsal: aot_eager)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no more modes after this many seconds")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="profile one more step of each --profile-modes mode")
    parser.add_argument("--profile-modes", nargs="+", default=["native-bf16", "O2"],
                        choices=list(MODES))
    parser.add_argument("--rehearse", action="store_true",
                        help="toy sizes on the CPU: a rehearsal of the GPU run")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    for flag in ("warmup", "rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget:g}")
    if args.profile < 0:
        parser.error(f"--profile must be 0 (off) or a positive count, got {args.profile}")
    if args.compile_modes is not None and args.compile == "off":
        parser.error("--compile-modes needs a compiled phase (--compile on or both)")
    args.backend = args.backend or ("aot_eager" if args.rehearse else "inductor")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.rehearse and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here, nothing was measured. Run it on a "
              "machine with a GPU, or rehearse it on the CPU with --rehearse.",
              file=sys.stderr)
        return 1
    device = torch.device("cpu" if args.rehearse else "cuda")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    start = time.monotonic()
    deadline = start + args.budget if args.budget else math.inf
    phases = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    print(device_header(device))
    print(f"{args.warmup} warm-up steps, then {args.rounds} interleaved rounds of "
          f"{args.steps} steps per mode; AdamW (fused); ratios to {BASELINE}"
          + ("; REHEARSAL at toy sizes on the CPU (speeds meaningless)" if args.rehearse
             else ""), flush=True)
    records: list[dict[str, Any]] = []
    for compiled in phases:  # every model eager first: the cheap half is never lost
        # Compiled, the models the targets weigh most come first (fp8's on the Llama
        # stack), and each gets an equal share of what is left of the budget.
        names = ([m for m in COMPILE_MODEL_PRIORITY if m in args.models] if compiled
                 else args.models)
        for i, name in enumerate(names):
            share = (deadline - time.monotonic()) / (len(names) - i)
            model_deadline = min(deadline, time.monotonic() + max(share, 0.0))
            work = workload(name, toy=args.rehearse)
            torch.manual_seed(0)
            with device:  # initialised where it trains: seconds less for the Llama stack
                base = work.make_model()
            if compiled:
                torch._dynamo.reset()
            modes = (args.compile_modes or args.modes) if compiled else args.modes
            records += run_phase(work, base, modes, compiled, args, device, model_deadline)
            del base
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"header": device_header(device), "rows": records}, f, indent=2)
    diverged = [f"{r['model']} {r['mode']} ({r['phase']})" for r in records
                if "loss" in r and not math.isfinite(r["loss"])]
    if diverged:
        print(f"gpu_throughput: non-finite final loss in {', '.join(diverged)}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
