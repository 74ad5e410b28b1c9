"""Peak memory of one O1 training step against native autocast, where the logits dominate.

A Llama-shaped causal LM built from ``transformers.LlamaConfig`` (vocabulary 32000,
hidden size 64, 2 layers, 4 heads, intermediate 128) on a batch of 4 x 128 tokens: the
logits (4 x 128 x 32000: 33 MB in bf16, 66 MB in fp32) outweigh everything else, as in
a real LM's last layers. One step: forward, loss, backward (the optimizer's step is the
same fp32 step in every mode and is left out). Two ways to compute the loss:

* ``inside``: the Hugging Face way, ``model(ids, labels=ids)``: the model upcasts its
  logits itself and returns the loss and the (bf16) logits;
* ``outside``: ``model(ids)``, then ``F.cross_entropy`` on the returned logits. Native
  computes it inside its autocast region (cross entropy is on its fp32 list): the
  reference for precision and memory. ``native-bf16`` computes it after the region, on
  the bf16 logits: less memory, a bf16 loss (shown for comparison only).

Modes: ``native`` (``torch.autocast("cpu", bfloat16)`` around the step's forward),
``O1`` (``ampkit.initialize(level="O1", dtype=torch.bfloat16)``: outputs the model did
not upcast for its own loss come back fp32) and ``O1-as_computed`` (the same with
``cast_model_outputs="as_computed"``: outputs as native hands them back; a loss outside
is computed in a ``torch.autocast`` region, as native computes it). Peak = parameters held
+ the highest point of the allocations made during the step (the PyTorch profiler's
memory events, as ``memory_o2.py`` measures the CPU); each configuration runs in this
one process, one after the other, from the same weights.

Run: ``python benchmarks/memory_o1_outputs.py [--vocab 32000] [--hidden 64]``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _training import _storage_bytes, peak_memory

import ampkit
from ampkit.tools.cli.args import positive_int


def build(vocab: int, hidden: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def step(mode: str, loss_at: str, model: torch.nn.Module, ids: torch.Tensor) -> float:
    """One forward, loss and backward; the loss's value."""
    region = (torch.autocast("cpu", torch.bfloat16) if mode.startswith("native")
              else contextlib.nullcontext())
    if loss_at == "inside":
        with region:
            out = model(ids, labels=ids)
        loss = out.loss
    else:
        vocab = model.config.vocab_size
        with region:
            out = model(ids)
            if mode == "native":
                loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab),
                                       ids[:, 1:].reshape(-1))
        if mode == "O1-as_computed":
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab),
                                       ids[:, 1:].reshape(-1))
        elif mode != "native":
            loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab),
                                   ids[:, 1:].reshape(-1))
    loss.backward()
    value = loss.item()
    del out, loss
    model.zero_grad(set_to_none=True)
    return value


def measure(mode: str, loss_at: str, base: torch.nn.Module, ids: torch.Tensor
            ) -> tuple[int, float]:
    model = copy.deepcopy(base)
    if mode == "O1":
        model = ampkit.initialize(model, level="O1", dtype=torch.bfloat16)
    elif mode == "O1-as_computed":
        model = ampkit.initialize(model, level="O1", dtype=torch.bfloat16,
                                  cast_model_outputs="as_computed")
    step(mode, loss_at, model, ids)  # warm-up
    held = _storage_bytes(model.parameters())
    with peak_memory(torch.device("cpu"), held) as result:
        value = step(mode, loss_at, model, ids)
    return result["peak"], value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=positive_int, default=32000)
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = build(args.vocab, args.hidden)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}; Llama vocab {args.vocab}, hidden {args.hidden}, "
          f"batch {args.batch} x {args.seq}")
    print(f"{'loss':8} {'mode':15} {'peak MiB':>9} {'/ native':>9} {'loss value':>12}")
    for loss_at, modes in (("inside", ("native", "O1", "O1-as_computed")),
                           ("outside", ("native", "O1", "O1-as_computed", "native-bf16"))):
        native = None
        for mode in modes:
            peak, value = measure(mode, loss_at, base, ids)
            native = native or peak
            print(f"{loss_at:8} {mode:15} {peak / 2**20:9.1f} {peak / native:8.3f}x "
                  f"{value:12.6f}")


if __name__ == "__main__":
    main()
