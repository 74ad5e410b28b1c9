"""Memory of pure bf16 training (master_weights="stochastic"/"kahan") vs fp32 and O2.

The GPT-style decoder of ``memory_o2.py`` (tied head, 4 heads), trained with AdamW,
measured the same way: two warm-up steps, then one measured step (forward, backward,
``optimizer.step()``, ``zero_grad``). Reported per configuration:

* bytes per parameter held between steps (parameters, masters, optimizer state and
  buffers, after ``zero_grad(set_to_none=True)``; the AdamW ``step`` counters are
  included, which is why fp32 shows a hair above 12; so is a pure optimizer's kept
  scratch, a constant of a few MiB);
* the peak of one step (held + the highest point of the step's allocations, torch
  profiler on CPU, the allocator's peak counter on CUDA), and its ratio to fp32;
* the peak of the model state (parameters, their gradients, the optimizer state and
  buffers: no activations, no temporaries, no kept scratch), sampled as each gradient
  is accumulated and around ``optimizer.step()``, and its ratio to fp32's; the "step
  in backward" configs (``initialize(..., step_in_backward=True)``) step each parameter
  as its gradient is ready and free it, so the gradients never all exist at once;
* with ``--time-steps N``: the median time of ``optimizer.step()`` over N more steps,
  measured outside the profiler (the pure modes' fp32 working copies and rounding are
  all inside it).

fp32 is run twice: with torch's CPU default (AdamW's for-loop implementation) and with
``foreach=True`` (torch's default on CUDA), whose whole-model temporaries raise its
peak. The pure modes chunk their step, so their inner optimizer's variant does not
change their peak.

Presets: ``light`` (d=256, 4 layers, vocab 512, batch 2 x 64: activation-light, the
parameters and their state dominate) and those of ``memory_o2.py`` (``all`` runs every
one but ``toy``, the rehearsal size).

Run: ``python benchmarks/memory_pure.py [--preset light|deep|wide|big-vocab|gpt-1024|toy|all]
[--device cpu|cuda] [--time-steps N]``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _training import GPT, GPTConfig, _device_name, _storage_bytes, live_training_tensors
from _training import peak_memory as _peak_memory
from memory_o2 import PRESETS as O2_PRESETS

import ampkit

PRESETS = {"light": (256, 4, 512, 2, 64), **O2_PRESETS}
CONFIGS = {  # name: (initialize kwargs or None for fp32, AdamW kwargs)
    "fp32": (None, {}),
    "fp32 foreach": (None, {"foreach": True}),
    "O2 (fp32 parameters)": ({"level": "O2"}, {}),
    "O2 stochastic": ({"level": "O2", "master_weights": "stochastic"}, {}),
    "O2 kahan": ({"level": "O2", "master_weights": "kahan"}, {}),
    "O2, step in backward": ({"level": "O2", "step_in_backward": True}, {}),
    "O2 stochastic, step in backward": ({"level": "O2", "master_weights": "stochastic",
                                         "step_in_backward": True}, {}),
    "O2 kahan, step in backward": ({"level": "O2", "master_weights": "kahan",
                                    "step_in_backward": True}, {}),
}


def measure(config: str, base: torch.nn.Module, ids: torch.Tensor,
            device: torch.device, time_steps: int = 0
            ) -> tuple[int, int, int, float | None]:
    """``(bytes held between steps, peak bytes of one step, peak bytes of the model
    state, median seconds of the step over time_steps more steps or None)``; in the
    step-in-backward configs the step is the backward pass, which holds it."""
    init, adamw = CONFIGS[config]
    model = copy.deepcopy(base).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **adamw)
    state_peak = [0]

    def sample(*_: object) -> None:
        held = _storage_bytes(live_training_tensors(model, optimizer, scratch=False),
                              device.type)
        state_peak[0] = max(state_peak[0], held)

    for p in model.parameters():  # before initialize's hooks: sees each gradient
        p.register_post_accumulate_grad_hook(sample)
    if init is not None:
        model, optimizer = ampkit.initialize(model, optimizer, dtype=torch.bfloat16, **init)
    in_backward = bool(init and init.get("step_in_backward"))

    def step() -> float:
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss.backward()
        if not in_backward:
            start = time.perf_counter()
            sample()
            optimizer.step()
            sample()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        return seconds

    for _ in range(2):
        step()
    held = _storage_bytes(live_training_tensors(model, optimizer), device.type)
    state_peak[0] = 0
    with _peak_memory(device, held) as memory:
        step()
    timed = statistics.median(step() for _ in range(time_steps)) if time_steps else None
    return held, memory["peak"], state_peak[0], timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="light", choices=["all", *PRESETS])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--time-steps", type=int, default=0,
                        help="also time optimizer.step() over this many steps (median)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("memory_pure: no CUDA device here; use --device cpu", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device: {_device_name(device)}; torch {torch.__version__}; bfloat16; AdamW")
    # "all": every size but the rehearsal's toy, which measures nothing
    for preset in [p for p in PRESETS if p != "toy"] if args.preset == "all" else [args.preset]:
        dim, layers, vocab, batch, seq = PRESETS[preset]
        torch.manual_seed(0)
        base = GPT(GPTConfig(vocab=vocab, dim=dim, heads=4, layers=layers, max_len=seq))
        ids = torch.randint(0, vocab, (batch, seq + 1), device=device)
        params = sum(p.numel() for p in base.parameters())
        print(f"\n{preset}: d={dim}, {layers} layers, vocab {vocab}, {params / 1e6:.2f}M "
              f"parameters, batch {batch} x {seq} tokens")
        timing = " optimizer.step (or backward) |" if args.time_steps else ""
        print(f"| config | held between steps | bytes/param | peak of one step | vs fp32 |"
              f" model state peak | bytes/param | vs fp32 |{timing}")
        print("|---|---|---|---|---|---|---|---|" + ("---|" if timing else ""))
        baseline = state_base = None
        for config in CONFIGS:
            held, peak, state, seconds = measure(config, base, ids, device,
                                                 args.time_steps)
            baseline = baseline or peak
            state_base = state_base or state
            timed = f" {seconds * 1e3:.1f} ms |" if seconds is not None else ""
            print(f"| {config} | {held / 2 ** 20:.1f} MiB | {held / params:.2f} | "
                  f"{peak / 2 ** 20:.1f} MiB | {peak / baseline:.2f}x | "
                  f"{state / 2 ** 20:.1f} MiB | {state / params:.2f} | "
                  f"{state / state_base:.2f}x |{timed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
