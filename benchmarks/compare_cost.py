"""What ``ampkit.compare`` costs on a 12-layer transformer, against a plain forward.

A GPT-2-shaped model built from a ``transformers`` config (12 layers; the hidden size,
batch and sequence length are options, random weights, eager attention) runs in a fresh
process per measurement, so each peak RSS is its own:

* ``plain``: one float32 forward with autograd on (what training's forward holds);
* ``compare``: ``ampkit.compare(model, ids, precision=...)``.

Each prints the wall time of the call, the RSS before it and the peak RSS of the
process (``ru_maxrss``); the table gives the peak's growth over the RSS before the call
too, which is what the call itself held. Run it with ``PYTHONPATH`` pointing at another
ampkit source tree to measure that one (the "before" of a change).

    python benchmarks/compare_cost.py --hidden 256 --layers 12 --batch 4 --seq 128
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings


def _build(args: argparse.Namespace) -> tuple[object, object]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    class Logits(torch.nn.Module):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids=ids).logits

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                        vocab_size=args.vocab, n_positions=args.seq,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = Logits(GPT2LMHeadModel(config))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    return model, ids


def _child(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    import torch

    import ampkit

    torch.set_num_threads(args.threads)
    model, ids = _build(args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cpu = time.thread_time()
    if args.child == "plain":
        model(ids)  # type: ignore[operator]
        calls = None
    else:
        result = ampkit.compare(model, ids, precision=args.precision)  # type: ignore[arg-type]
        calls = len(result.ops)
    print(json.dumps({"wall_s": time.perf_counter() - start,
                      "thread_cpu_s": time.thread_time() - cpu,
                      "rss_before_mib": before / 1024,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "op_calls": calls}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", default="torch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=("plain", "compare"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return
    given = [a for a in (argv if argv is not None else sys.argv[1:])]
    print(f"GPT-2-shaped: {args.layers} layers, hidden {args.hidden}, batch {args.batch} "
          f"x {args.seq} tokens, vocab {args.vocab}, {args.threads} torch thread(s)\n")
    print("| Run | Wall time | Thread CPU time | Peak RSS | Peak RSS - RSS before the call "
          "| Op calls |")
    print("|---|---|---|---|---|---|")
    for child in ("plain", "compare"):
        done = subprocess.run([sys.executable, __file__, *given, "--child", child],
                              capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {child} | {row['wall_s']:.2f} s | {row['thread_cpu_s']:.2f} s "
              f"| {row['peak_rss_mib']:.0f} MiB "
              f"| {row['peak_rss_mib'] - row['rss_before_mib']:.0f} MiB "
              f"| {row['op_calls'] or '-'} |")


if __name__ == "__main__":
    main()
