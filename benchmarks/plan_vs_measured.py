"""``ampkit.plan``'s peak against the measured peak of the same training step, per mode.

A transformers Llama stack (``--hidden``, ``--layers``, ``--seq``, ``--batch``) is
planned with ``ampkit.plan`` (one process, the device's autocast lists), then each mode
runs for real on ``--device``: two steps, the second measured. The real peak on CUDA is
the caching allocator's ``max_memory_allocated`` over the second step (reset at its
start); on the CPU, the running sum of the allocations and frees torch's profiler
records from before the model is built, at its highest inside the second step.

Prints a markdown table: mode, planned peak, measured peak, planned / measured - 1.

Run: ``python benchmarks/plan_vs_measured.py [--device cuda|cpu] [--hidden 1024]
[--layers 4] [--seq 2048] [--batch 2] [--modes O2,pure-stochastic,...]``
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import torch

MODES = ("fp32", "bf16-autocast", "O1", "O2", "O3", "pure-stochastic", "pure-kahan",
         "pure-stochastic+step-in-backward", "fp8")


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(args.hidden // 256, 1), vocab_size=32000,
                         max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    return config


def _measure(mode: str, config: Any, device: torch.device, args: argparse.Namespace) -> int:
    from transformers import LlamaForCausalLM

    from ampkit.tools.plan.setup import build_step

    def inputs() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
        return {"input_ids": ids, "labels": ids}

    def model() -> torch.nn.Module:
        return LlamaForCausalLM(config).to(device)

    if device.type == "cuda":
        step = build_step(mode, "none", model, inputs, device_policy="cuda")
        step.run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step.run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build_step(mode, "none", model, inputs, device_policy="cpu")
        for measured in (contextlib.nullcontext(), record_function("plan-measured-step")):
            with measured:
                step.run()
    events = prof.profiler.kineto_results.events()
    mark = next(e for e in events if e.name() == "plan-measured-step")
    start, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    running = highest = 0
    for when, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events
                               if e.name() == "[memory]" and e.device_type() == DeviceType.CPU):
        running += nbytes
        if start <= when <= end:
            highest = max(highest, running)
    return highest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)

    from transformers import LlamaForCausalLM

    import ampkit

    device = torch.device(args.device)
    config = _config(args)
    modes = args.modes.split(",")

    def inputs() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        return {"input_ids": ids, "labels": ids}

    report = ampkit.plan(lambda: LlamaForCausalLM(config), inputs, modes=modes,
                         device_policy="cuda" if device.type == "cuda" else "cpu")
    print(f"Llama stack: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
          f"{args.seq} tokens, AdamW, on {device.type}")
    print("| mode | planned peak | measured peak | planned / measured - 1 |")
    print("|---|---|---|---|")
    for row in report.rows:
        mode = row["mode"]
        if row["peak"] is None:
            print(f"| {mode} | {row['note']} | - | - |")
            continue
        try:
            real = _measure(mode, config, device, args)
        except (RuntimeError, ValueError, ImportError) as error:
            print(f"| {mode} | {row['peak'] / 2**20:.1f} MiB | did not run: "
                  f"{' '.join(str(error).split())[:120]} | - |")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"| {mode} | {row['peak'] / 2**20:.1f} MiB | {real / 2**20:.1f} MiB | "
              f"{row['peak'] / real - 1:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
