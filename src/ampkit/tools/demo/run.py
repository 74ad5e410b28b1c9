"""The demo: one small CNN trained on scikit-learn's digits in fp32 and at each AMP level.

:func:`run_demo` trains the same :class:`DigitsCNN` once per :class:`RunConfig` (same
seed, same initial weights, same data split, same batch order) and measures, per run:

* test accuracy and the final training loss (mean over the last epoch's steps);
* time per step: the median wall time of the training steps after the first (the
  first step also warms up kernels, and is the one that is measured below);
* peak memory: the most memory torch held for the run, from building the model to the
  end of its first training step (model parameters, optimizer state, activations,
  gradients; the data set is loaded before and is not counted). On CUDA that is
  ``torch.cuda.max_memory_allocated`` above the allocation before the run; on CPU, where
  torch keeps no such counter, torch's profiler with ``profile_memory=True`` reports
  every CPU allocation and free, and the peak of their running total is taken;
* the loss scaler's skipped steps and its scale after every step (float16 runs);
* the share of op calls that ran in low precision, counted by
  :func:`ampkit.tools.ops.op_stats.collect_op_stats` over the first training step.

The training code uses ampkit the way a user would: ``ampkit.initialize`` and
``ampkit.GradScaler``. :func:`training_code` prints those lines for a configuration;
they are the ones :func:`run_demo` executes.

Example:
    >>> from ampkit.tools.demo.run import DemoSettings, demo_configurations, run_demo
    >>> settings = DemoSettings(epochs=1, configurations=demo_configurations(["fp32"]),
    ...                         device="cpu")
    >>> result = run_demo(settings)
    >>> [run.name for run in result.runs], result.runs[0].test_accuracy > 0.5
    (['fp32'], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.common.arguments import default_device_type
from ampkit.tools.demo.digits import DigitsCNN, DigitsData, batch_order, load_digits_data
from ampkit.tools.demo.pure_curves import PURE_DEMO_CURVES, train_curves
from ampkit.tools.ops.op_stats import collect_op_stats

__all__ = [
    "DEFAULT_EPOCHS",
    "DTYPE_CHOICES",
    "DemoObserver",
    "DemoResult",
    "DemoSettings",
    "LEVEL_CHOICES",
    "TRAINING_CODE_CONTEXT",
    "RunConfig",
    "cpu_description",
    "RunResult",
    "demo_configurations",
    "resolve_device",
    "run_demo",
    "training_code",
]

#: Epochs of the default run: fp32 reaches about 97% test accuracy, and all seven
#: configurations finish well inside three minutes on two CPU cores.
DEFAULT_EPOCHS = 5

#: Accepted ``levels``; "O0" is apex's name for the fp32 run and means the same.
LEVEL_CHOICES: tuple[str, ...] = ("fp32", "O0", "O1", "O2", "O3")

#: Accepted ``dtypes``, by their short names.
DTYPE_CHOICES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

_SHORT_DTYPE_NAMES = {dtype: name for name, dtype in DTYPE_CHOICES.items()}

#: The default growth interval of the float16 runs' dynamic loss scale. Torch's 2000
#: suits runs of many thousand steps; the demo's hundred steps would show a flat line.
FP16_GROWTH_INTERVAL = 20


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training configuration: ``level`` (``"fp32"``, ``"O1"``, ``"O2"``, ``"O3"``)
    and, for the AMP levels, the low-precision ``dtype``.

    Float16 runs use dynamic loss scaling; bfloat16 and fp32 runs use none (their
    ``GradScaler`` is constructed with ``enabled=False``).

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.run import RunConfig
        >>> RunConfig("O2", torch.float16).name, RunConfig("fp32").name
        ('O2-fp16', 'fp32')
    """

    level: str
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.level not in ("fp32", "O1", "O2", "O3"):
            raise ValueError(f"level must be one of 'fp32', 'O1', 'O2', 'O3', "
                             f"got {self.level!r}")
        if self.level == "fp32" and self.dtype is not None:
            raise ValueError(f"the fp32 run takes no dtype, got dtype={self.dtype}")
        if self.level != "fp32" and self.dtype not in _SHORT_DTYPE_NAMES:
            raise ValueError(f"dtype of an {self.level} run must be torch.bfloat16 or "
                             f"torch.float16, got {self.dtype!r}")

    @property
    def name(self) -> str:
        """``"fp32"`` or ``"<level>-<bf16|fp16>"``."""
        if self.dtype is None:
            return self.level
        return f"{self.level}-{_SHORT_DTYPE_NAMES[self.dtype]}"

    @property
    def loss_scaling(self) -> bool:
        """Whether the run scales its loss (float16 runs do)."""
        return self.dtype == torch.float16

    @property
    def scaler_options(self) -> dict[str, Any]:
        """Keyword arguments of the run's ``ampkit.GradScaler``."""
        if self.loss_scaling:
            return {"growth_interval": FP16_GROWTH_INTERVAL}
        return {"enabled": False}


def _parse_choices(values: Iterable[str] | None, accepted: Sequence[str],
                   argument: str) -> list[str]:
    chosen: list[str] = []
    for value in values or ():
        if value not in accepted:
            raise ValueError(f"{argument} must name only {', '.join(accepted)}, "
                             f"got {value!r}")
        if value not in chosen:
            chosen.append(value)
    return chosen


def demo_configurations(levels: Iterable[str] | None = None,
                        dtypes: Iterable[str] | None = None) -> tuple[RunConfig, ...]:
    """The runs for the given ``levels`` and ``dtypes``.

    Without ``levels`` the set is the default: fp32, O1/O2/O3 in bf16, and O1/O2 in
    fp16 (fp16 parameters with no fp32 truth and no loss scaling, O3-fp16, is left out:
    its gradients underflow). Given ``levels``, every listed AMP level runs in every
    listed dtype (``dtypes`` defaults to bf16 and fp16), and fp32 (alias O0) runs once
    if listed. Order: fp32, then the bf16 runs, then the fp16 runs, each by level.

    Example:
        >>> from ampkit.tools.demo.run import demo_configurations
        >>> [c.name for c in demo_configurations()]
        ['fp32', 'O1-bf16', 'O2-bf16', 'O3-bf16', 'O1-fp16', 'O2-fp16']
        >>> [c.name for c in demo_configurations(["O3", "fp32"], ["fp16"])]
        ['fp32', 'O3-fp16']
    """
    explicit = levels is not None
    chosen_levels = _parse_choices(levels, LEVEL_CHOICES, "levels")
    chosen_dtypes = _parse_choices(dtypes, tuple(DTYPE_CHOICES), "dtypes")
    if explicit and not chosen_levels:
        raise ValueError("levels must name at least one of " + ", ".join(LEVEL_CHOICES))
    if dtypes is not None and not chosen_dtypes:
        raise ValueError("dtypes must name at least one of " + ", ".join(DTYPE_CHOICES))
    if not explicit:
        chosen_levels = ["fp32", "O1", "O2", "O3"]
    if dtypes is None:
        chosen_dtypes = list(DTYPE_CHOICES)
    configs: list[RunConfig] = []
    if "fp32" in chosen_levels or "O0" in chosen_levels:
        configs.append(RunConfig("fp32"))
    for short in DTYPE_CHOICES:
        if short not in chosen_dtypes:
            continue
        for level in ("O1", "O2", "O3"):
            if level not in chosen_levels:
                continue
            if not explicit and level == "O3" and short == "fp16":
                continue
            configs.append(RunConfig(level, DTYPE_CHOICES[short]))
    return tuple(configs)


def _check_device_name(device: Any) -> str:
    """Check the name of a device (not whether this machine has it)."""
    index = device.removeprefix("cuda:") if isinstance(device, str) else ""
    if device in ("auto", "cpu", "cuda") or (device != index and index.isdigit()):
        name: str = device
        return name
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', "
                     f"got {device!r}")


def resolve_device(device: str) -> torch.device:
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or
    ``"cuda:<index>"`` as a ``torch.device``.

    Raises:
        ValueError: for any other name.
        RuntimeError: for a CUDA device this machine does not have.

    Example:
        >>> from ampkit.tools.demo.run import resolve_device
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("gpu")
        Traceback (most recent call last):
        ...
        ValueError: device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got 'gpu'
    """
    device = _check_device_name(device)
    if device == "auto":
        return torch.device(default_device_type())
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was asked for, but no CUDA GPU is "
                           f"available (torch.cuda.is_available() is False); use "
                           f"--device cpu")
    resolved = torch.device(device)
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {device!r} was asked for, but this machine has "
                           f"{torch.cuda.device_count()} CUDA device(s)")
    return resolved


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """What :func:`run_demo` trains, and how long.

    Example:
        >>> from ampkit.tools.demo.run import DemoSettings
        >>> DemoSettings(epochs=2).epochs
        2
        >>> DemoSettings(epochs=0)
        Traceback (most recent call last):
        ...
        ValueError: epochs must be a positive int, got 0
    """

    epochs: int = DEFAULT_EPOCHS
    device: str = "auto"
    configurations: tuple[RunConfig, ...] = dataclasses.field(
        default_factory=demo_configurations)
    seed: int = 0
    batch_size: int = 64
    learning_rate: float = 0.05
    #: steps of the pure-bf16 curves (fp32, round-to-nearest, stochastic rounding) of a
    #: tiny character GPT (:mod:`ampkit.tools.demo.pure_curves`); 0 skips them
    pure_bf16_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        steps = self.pure_bf16_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"pure_bf16_steps must be a non-negative int, got {steps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a positive number, "
                             f"got {self.learning_rate!r}")
        configs = tuple(self.configurations)
        if not configs or not all(isinstance(c, RunConfig) for c in configs):
            raise ValueError("configurations must be a non-empty sequence of RunConfig, "
                             f"got {self.configurations!r}")
        object.__setattr__(self, "configurations", configs)
        _check_device_name(self.device)


#: What the reader of :func:`training_code` needs around it.
TRAINING_CODE_CONTEXT = ("after import ampkit, torch and import torch.nn.functional as F; "
                         "model, optimizer and batches are yours")

# The printed code and the code run below are kept equal by tests/tools/test_demo.py, which
# runs the printed text and compares its losses with the demo's, step for step.
_TRAINING_CODE = """\
model, optimizer = ampkit.initialize(model, optimizer, level="{level}", dtype=torch.{dtype})
scaler = ampkit.GradScaler("{device_type}"{scaler_options})
for x, y in batches:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""


def training_code(config: RunConfig, device_type: str = "cpu") -> str:
    """The ampkit lines a configuration's run executes, to copy into a training loop
    (see :data:`TRAINING_CODE_CONTEXT` for what they assume).

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.run import RunConfig, training_code
        >>> code = training_code(RunConfig("O2", torch.float16)).splitlines()
        >>> for line in code[:2]:  # then the six lines of the loop
        ...     print(line)
        model, optimizer = ampkit.initialize(model, optimizer, level="O2", dtype=torch.float16)
        scaler = ampkit.GradScaler("cpu", growth_interval=20)
        >>> len(code), code[-1]
        (8, '    scaler.update()')
    """
    options = "".join(f", {key}={value!r}" for key, value in config.scaler_options.items())
    text = _TRAINING_CODE.format(level=config.level, dtype=str(config.dtype).split(".")[-1],
                                 device_type=device_type, scaler_options=options)
    if config.level == "fp32":
        text = text.split("\n", 1)[1]
    return text.rstrip("\n")


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    # every level hands the logits back in fp32 (O1 too): the loss is fp32, as native
    # autocast computes it inside its region
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one configuration's run measured (see the module docstring for how).

    ``final_loss_scale`` is ``None`` and ``loss_scales`` empty for runs without loss
    scaling; ``samples_per_second`` is ``batch_size / step_time_s``.
    """

    name: str
    level: str
    dtype: str | None
    test_accuracy: float
    final_loss: float
    step_time_s: float
    samples_per_second: float
    peak_memory_bytes: int
    skipped_steps: int
    final_loss_scale: float | None
    low_precision_share: float
    losses: tuple[float, ...]
    loss_scales: tuple[float, ...]
    op_table: str
    #: the first training step's op calls: (op, float16, bfloat16, float32, other)
    op_counts: tuple[tuple[str, int, int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """All runs of one :func:`run_demo` call, and where they ran."""

    settings: DemoSettings
    device: str
    device_name: str
    runs: tuple[RunResult, ...]
    wall_time_s: float
    torch_version: str
    ampkit_version: str
    memory_measure: str
    #: mode ("fp32", "nearest", "stochastic") -> training losses of the pure-bf16 curves
    #: (empty when ``settings.pure_bf16_steps`` is 0)
    pure_bf16_curves: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

    @property
    def example_config(self) -> RunConfig | None:
        """The run whose code is shown to the user: O2-fp16, else O2-bf16, else the
        first mixed-precision run; ``None`` when only fp32 ran."""
        configs = self.settings.configurations
        for wanted in (RunConfig("O2", torch.float16), RunConfig("O2", torch.bfloat16)):
            if wanted in configs:
                return wanted
        return next((c for c in configs if c.level != "fp32"), None)

    def example_code(self) -> str:
        """:func:`training_code` of :attr:`example_config` ("" when only fp32 ran)."""
        config = self.example_config
        return "" if config is None else training_code(config, torch.device(self.device).type)


class DemoObserver(Protocol):
    """Receives progress from :func:`run_demo` (the CLI draws progress bars with it)."""

    def run_started(self, config: RunConfig, total_steps: int) -> None:
        """A run begins; it will take ``total_steps`` training steps."""

    def step_finished(self, config: RunConfig, step: int, loss: float) -> None:
        """Training step ``step`` (1-based) of the run finished with ``loss``."""

    def run_finished(self, result: RunResult) -> None:
        """A run finished and was evaluated."""


class _Silent:
    def run_started(self, config: RunConfig, total_steps: int) -> None:
        pass

    def step_finished(self, config: RunConfig, step: int, loss: float) -> None:
        pass

    def run_finished(self, result: RunResult) -> None:
        pass


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Mute file descriptor 2 briefly: torch's profiler backend writes a log line to it
    when it starts and stops, which would tear through the progress bars."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable fd 2 (embedded interpreters): nothing to mute
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _PeakMemory:
    """Peak torch memory from ``__enter__`` to ``__exit__``, above the start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0
        self._profiler: Any = None
        self._base = 0

    def __enter__(self) -> _PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _native_stderr_silenced():
                self._profiler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        with _native_stderr_silenced():
            self._profiler.stop()
        if exc[0] is None:
            self.peak_bytes = _cpu_peak_from_profile(self._profiler)


def _cpu_peak_from_profile(profiler: Any) -> int:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    # Each allocation and free is one "[memory]" event; their running total, in time
    # order, is the memory the region held (on CPU, device type 0).
    changes = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                     if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: /proc/cpuinfo flags of native bf16 and fp16 arithmetic.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_FP16_FLAGS = ("avx512_fp16", "amx_fp16")


def cpu_description() -> str:
    """The CPU's model, core count, torch's threads and instruction set, and whether
    it has native bf16 and fp16 arithmetic (flags from ``/proc/cpuinfo``): results on
    the CPU depend on all of them.

    Example:
        >>> from ampkit.tools.demo.run import cpu_description
        >>> "torch thread" in cpu_description() and "native bf16" in cpu_description()
        True
    """
    model, flags = "", set[str]()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    cores, threads = os.cpu_count() or 0, torch.get_num_threads()
    capability = torch.backends.cpu.get_cpu_capability()

    def native(names: tuple[str, ...]) -> str:
        found = [name for name in names if name in flags]
        return ", ".join(found) if found else ("no" if flags else "unknown")

    return (f"{model or platform.processor() or 'CPU'} ({cores} cores, {threads} torch "
            f"thread{'' if threads == 1 else 's'}; torch CPU capability {capability}; "
            f"native bf16: {native(_BF16_FLAGS)}; native fp16: {native(_FP16_FLAGS)})")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_description()


def _run_one(config: RunConfig, settings: DemoSettings, data: DigitsData,
             device: torch.device, observer: DemoObserver) -> RunResult:
    batches = batch_order(len(data.y_train), settings.batch_size, settings.epochs,
                           settings.seed)
    total_steps = sum(len(epoch) for epoch in batches)
    observer.run_started(config, total_steps)
    losses: list[float] = []
    scales: list[float] = []
    step_times: list[float] = []
    memory = _PeakMemory(device)
    with memory:
        # Same initial weights for every run, without touching the caller's RNG.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(settings.seed)
            model: nn.Module = DigitsCNN().to(device)
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=settings.learning_rate, momentum=0.9)
        if config.level != "fp32":
            model, optimizer = ampkit.initialize(model, optimizer, level=config.level,
                                                 dtype=config.dtype)
        scaler = ampkit.GradScaler(device.type, **config.scaler_options)
        first = batches[0][0]
        x, y = data.x_train[first], data.y_train[first]
        with collect_op_stats() as op_stats:
            loss = _train_step(model, optimizer, scaler, x, y)
        _synchronize(device)
    step = 1
    losses.append(loss.item())
    if config.loss_scaling:
        scales.append(scaler.get_scale())
    observer.step_finished(config, step, losses[-1])
    for epoch, epoch_batches in enumerate(batches):
        for index in epoch_batches[1:] if epoch == 0 else epoch_batches:
            x, y = data.x_train[index], data.y_train[index]
            _synchronize(device)
            start = time.perf_counter()
            loss = _train_step(model, optimizer, scaler, x, y)
            _synchronize(device)
            step_times.append(time.perf_counter() - start)
            step += 1
            losses.append(loss.item())
            if config.loss_scaling:
                scales.append(scaler.get_scale())
            observer.step_finished(config, step, losses[-1])
    model.eval()
    with torch.no_grad():
        predictions = model(data.x_test).float().argmax(dim=1)
    accuracy = (predictions == data.y_test).double().mean().item()
    last_epoch = losses[-len(batches[-1]):]
    step_time = statistics.median(step_times) if step_times else float("nan")
    result = RunResult(
        name=config.name, level=config.level,
        dtype=None if config.dtype is None else str(config.dtype).split(".")[-1],
        test_accuracy=accuracy, final_loss=statistics.fmean(last_epoch),
        step_time_s=step_time, samples_per_second=settings.batch_size / step_time,
        peak_memory_bytes=int(memory.peak_bytes), skipped_steps=int(scaler.skipped_steps),
        final_loss_scale=scales[-1] if scales else None,
        low_precision_share=op_stats.low_precision_share,
        losses=tuple(losses), loss_scales=tuple(scales), op_table=op_stats.table(),
        op_counts=tuple((name, c.float16, c.bfloat16, c.float32, c.other)
                        for name, c in op_stats.counts.items()),
    )
    observer.run_finished(result)
    return result


def run_demo(settings: DemoSettings | None = None,
             observer: DemoObserver | None = None) -> DemoResult:
    """Train every configuration of ``settings`` and return what was measured.

    Raises:
        RuntimeError: when ``settings.device`` names a CUDA device that is not there.

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.run import DemoSettings, RunConfig, run_demo
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
        ...                                configurations=(RunConfig("O1", torch.bfloat16),)))
        >>> run = result.runs[0]
        >>> run.name, 0.0 < run.low_precision_share < 1.0, run.final_loss_scale
        ('O1-bf16', True, None)
    """
    settings = DemoSettings() if settings is None else settings
    observer = _Silent() if observer is None else observer
    device = resolve_device(settings.device)
    started = time.perf_counter()
    data = load_digits_data(settings.seed, device)
    runs = tuple(_run_one(config, settings, data, device, observer)
                 for config in settings.configurations)
    curves: dict[str, tuple[float, ...]] = {}
    if settings.pure_bf16_steps:  # small and on the CPU: a few seconds
        curves = {mode: curve.losses for mode, curve in train_curves(
            PURE_DEMO_CURVES, steps=settings.pure_bf16_steps, seed=settings.seed,
            lr=3e-4, dim=32, layers=1, context=32, batch=8).items()}
    measure = ("torch.cuda.max_memory_allocated above the start of the run, from model "
               "creation to the end of the first training step" if device.type == "cuda"
               else "peak of torch's CPU allocations (torch.profiler, profile_memory=True) "
                    "from model creation to the end of the first training step")
    return DemoResult(settings=settings, device=str(device), device_name=_device_name(device),
                      runs=runs, wall_time_s=time.perf_counter() - started,
                      torch_version=torch.__version__, ampkit_version=ampkit.__version__,
                      memory_measure=measure, pure_bf16_curves=curves)
