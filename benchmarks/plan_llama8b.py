"""``ampkit.plan`` on a Llama-3-8B-shaped model: the planner's own time and resident
memory, and the per-rank table it computes.

The model is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` with
Llama 3 8B's shapes (hidden 4096, 32 layers, 32 heads with 8 key/value heads, MLP
14336, vocabulary 128256, rope theta 500000); it is built inside the planner's fake
mode, so none of its 8.03 billion parameters is allocated. The inputs are
``--batch`` sequences of ``--seq`` tokens per rank, with labels (transformers computes
the loss). Layout: FSDP2 over the decoder layers (``--parallel``, ``--world-sizes``).

Reported: the table per world size (bytes per rank), the seconds each plan took, and
the process's peak resident set size (``ru_maxrss``) at the end.

Run: ``python benchmarks/plan_llama8b.py [--world-sizes 64,1024] [--seq 8192]
[--batch 1] [--modes O2,pure-stochastic,...] [--json OUT] [--tiny]``
(``--tiny``: a 2-layer, 256-wide model of the same structure, for a rehearsal).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import torch


def llama_config(tiny: bool) -> Any:
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                           max_position_embeddings=512, rope_theta=500000.0)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="64,1024")
    parser.add_argument("--parallel", default="fsdp2")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--modes", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)

    from transformers import LlamaForCausalLM

    import ampkit

    config = llama_config(args.tiny)
    config._attn_implementation = "sdpa"
    seq = min(args.seq, config.max_position_embeddings)

    def model() -> torch.nn.Module:
        return LlamaForCausalLM(config)

    def inputs(batch: int = args.batch) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        return {"input_ids": ids, "labels": ids}

    results = []
    torch.set_num_threads(1)
    for world in (int(w) for w in args.world_sizes.split(",")):
        start = time.perf_counter()
        report = ampkit.plan(model, inputs, world_size=world, parallel=args.parallel,
                             modes=None if args.modes is None else args.modes.split(","))
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(report.table())
        print(f"planned in {seconds:.1f} s; peak resident memory so far "
              f"{rss / 2**30:.2f} GiB\n", flush=True)
        results.append({"seconds": seconds, "max_rss": rss, "seq": seq,
                        "batch": args.batch, **report.to_dict()})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
