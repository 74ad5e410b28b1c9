"""Per-rank memory of pure bf16 under FSDP2, with and without the optimizer step inside
backward (``initialize(..., step_in_backward=True)``), on gloo ranks of one machine.

The GPT-style decoder of ``memory_pure.py`` (tied embedding and head), converted with
``ampkit.initialize(level="O2", master_weights=...)``, sharded with
``ampkit.fsdp.fully_shard`` (one group per block, the root holding the embeddings and
the head), its AdamW made ready with ``ampkit.fsdp.prepare_optimizer``. Two warm-up
steps, then one measured step; reported per rank (the largest over the ranks):

* the model state held between steps (parameter shards, optimizer state, buffers);
* the peak of the model state during the step (held + gradient shards + the pure
  step's working copies, sampled as each gradient shard is ready and around
  ``optimizer.step()``);
* the peak of all allocations of one step (the torch profiler's record on the CPU:
  activations, FSDP2's all-gathered parameters and unsharded gradients included).

The presets vary the tied embedding's share of the parameters (the largest
parameter): ``light`` (d=256, 4 layers, vocab 512: 4%), ``tied-25`` (vocab 4096: 25%)
and ``tied-40`` (vocab 8192: 40%); ``toy`` is the rehearsal size.

Run: ``python benchmarks/memory_pure_fsdp.py [--preset light|tied-25|tied-40|toy|all]
[--ranks N] [--rounding stochastic|kahan]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _training import GPT, GPTBlock, GPTConfig, _storage_bytes, live_training_tensors
from _training import peak_memory as _peak_memory

PRESETS = {  # name: (dim, layers, vocab, batch, seq)
    "light": (256, 4, 512, 2, 64),
    "tied-25": (256, 4, 4096, 2, 64),
    "tied-40": (256, 4, 8192, 2, 64),
    "toy": (64, 2, 256, 2, 16),  # the rehearsal size: seconds, numbers meaningless
}
ALL = ("light", "tied-25", "tied-40")


def _held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's shards of the model state (DTensors by their local part)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        to_local = getattr(t, "to_local", None)
        return to_local() if to_local is not None else t

    return _storage_bytes(local(t) for t in live_training_tensors(model, optimizer))


def _measure(rank: int, world: int, preset: str, rounding: str, in_backward: bool
             ) -> tuple[int, int, int]:
    """``(held, model-state peak, peak of one step)`` bytes on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import ampkit
    import ampkit.fsdp

    dim, layers, vocab, batch, seq = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=vocab, dim=dim, heads=4, layers=layers, max_len=seq))
    model = ampkit.initialize(model, level="O2", dtype=torch.bfloat16,
                              master_weights=rounding, step_in_backward=in_backward)
    ampkit.fsdp.fully_shard(model, blocks=[GPTBlock], mesh=init_device_mesh("cpu", (world,)))
    optimizer = ampkit.fsdp.prepare_optimizer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    state_peak = [0]

    def sample(*_: object) -> None:
        held = _held(model, optimizer)
        state_peak[0] = max(state_peak[0], held)

    for p in model.parameters():  # FSDP2 calls these with each reduced gradient shard
        p.register_post_accumulate_grad_hook(sample)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)

    def step() -> None:
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        if not in_backward:
            sample()
            optimizer.step()
            sample()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    held = _held(model, optimizer)
    state_peak[0] = held
    with _peak_memory(torch.device("cpu"), held) as memory:
        step()
    return held, state_peak[0], memory["peak"]


def _rank(rank: int, world: int, store: str, presets: list[str], rounding: str,
          out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        results = {(preset, in_backward): _measure(rank, world, preset, rounding, in_backward)
                   for preset in presets for in_backward in (False, True)}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="light", choices=["all", *PRESETS])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounding", default="stochastic", choices=["stochastic", "kahan"])
    args = parser.parse_args(argv)
    if args.ranks < 1:
        print("memory_pure_fsdp: --ranks must be at least 1", file=sys.stderr)
        return 2
    presets = list(ALL) if args.preset == "all" else [args.preset]
    for name, value in (("CUDA_VISIBLE_DEVICES", ""),):  # gloo ranks on the CPU only
        os.environ[name] = value
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
        if loopback is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(args.ranks, os.path.join(out, "store"), presets,
                                        args.rounding, out),
                           nprocs=args.ranks, start_method="spawn")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(args.ranks)]
    print(f"torch {torch.__version__}; {args.ranks} gloo ranks (CPU); pure bf16 "
          f"({args.rounding}); AdamW; the largest rank's bytes")
    for preset in presets:
        dim, layers, vocab, batch, seq = PRESETS[preset]
        base = GPT(GPTConfig(vocab=vocab, dim=dim, heads=4, layers=layers, max_len=seq))
        params = sum(p.numel() for p in base.parameters())
        share = base.tok.weight.numel() / params
        print(f"\n{preset}: d={dim}, {layers} layers, vocab {vocab}, {params / 1e6:.2f}M "
              f"parameters, tied embedding {share:.0%} of them, batch {batch} x {seq} "
              f"tokens per rank")
        print("| step | held between steps | model state peak | B/param of the rank's "
              "share | peak of one step |")
        print("|---|---|---|---|---|")
        for in_backward in (False, True):
            held, state, peak = (max(r[preset, in_backward][i] for r in ranks)
                                 for i in range(3))
            label = "in backward" if in_backward else "ordinary"
            print(f"| {label} | {_mib(held)} | {_mib(state)} | "
                  f"{state / (params / args.ranks):.2f} | {_mib(peak)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
