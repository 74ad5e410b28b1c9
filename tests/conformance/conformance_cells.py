"""The conformance matrix's table: architectures x modes x machinery, and what each cell
checks, against fp32 training and native autocast.

A cell trains (or runs) one real architecture, built from a config with random
initialisation, for a few steps in one mode through one piece of PyTorch's machinery,
and compares what it got with a reference that did the same work:

* fp32 training (no ampkit), within the mode's tolerance (:data:`TOLERANCES`);
* native ``torch.autocast`` (+ ``torch.amp.GradScaler``), bit for bit, where the design
  promises it (O1, the ``ampkit.torch`` dialect);
* the same mode, uninterrupted, bit for bit, for the resumes (``state_dict``,
  ``torch.save``/``load`` of whole objects, ``copy.deepcopy``);
* a model newly set up in the same mode from the edited state, bit for bit, for every
  forward after a ``.data`` edit (no low-precision copy may be stale);
* exact dtype rules (parameters, buffers, the ops native autocast runs in fp32, fp8's
  layer choice against ``fp8_report``) and the errors of wrong orders.

Models are built once per process per architecture (:func:`fresh` deep-copies a cached
pristine one) and references are cached per (architecture, machinery), so a cell costs
one short training run of its own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

BF16, FP16 = torch.bfloat16, torch.float16
VOCAB, HIDDEN, SEQ, BATCH = 128, 32, 8, 2  # every dim a multiple of 16 (fp8)
LR = 1e-2
STEPS = 3

# --------------------------------------------------------------------------------------
# Tolerances: |loss - loss_fp32| <= atol + rtol * |loss_fp32|, at every step of a cell.
#
# Why these numbers: u is the unit roundoff of the format the mode computes in. A few
# steps of a 2-layer model chain ~10-20 rounded ops per loss, and the errors of
# independent roundings add up like a random walk, so a loss drifts by a small multiple
# of u. The largest relative drift measured over the whole matrix (every cell, torch
# 2.13 CPU, AMPKIT_CONFORMANCE_RECORD; the RESULTS "Conformance matrix" section) was
# 1.6e-2 for bf16, 8.1e-3 for fp16, 2.6e-2 for bf16 parameters and 8.1e-2 for fp8 (BERT,
# whose 2-example classification loss is the most sensitive); each rtol is 1.5-2.5x
# that. Tolerances catch numerics gone wrong, not staleness: whether a forward saw an
# edit is checked bit for bit against a freshly set-up twin (data_edit_between_steps),
# and dtypes are checked exactly (dtype_invariants).
TOLERANCES: dict[str, tuple[float, float, str]] = {
    # name: (rtol, atol, why)
    "fp32": (1e-5, 1e-6, "O0 runs the fp32 ops; only summation order (compile, "
             "recompute) may differ"),
    "fp16": (1.5e-2, 1e-3, "fp16 has u = 2**-11; its narrow range is the scaler's job, "
             "so a step skipped on overflow would show here"),
    "bf16": (4e-2, 2e-3, "bf16 has u = 2**-8 (8 bits of mantissa): activations and "
             "weight copies round at every op"),
    "bf16_weights": (6e-2, 3e-3, "bf16 parameters (O3, pure bf16): the weights "
                     "themselves and each update round to bf16 as well"),
    "fp8": (1.2e-1, 5e-3, "fp8 e4m3 has u = 2**-4 on the converted matmuls, the rest "
            "of the model is O2 bf16"),
}


def within(got: float, ref: float, tolerance: str) -> bool:
    rtol, atol, _ = TOLERANCES[tolerance]
    return math.isfinite(got) and abs(got - ref) <= atol + rtol * abs(ref)


# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------


class CNN(nn.Module):
    """Two conv blocks with BatchNorm, then a small MLP head."""

    def __init__(self) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                                    nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16),
                                    nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4, 32), nn.GELU(),
                                  nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))
        self.checkpointing: bool | None = None  # None: off; else use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in (self.block1, self.block2):
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x.requires_grad_(True) if self.checkpointing else x,
                               use_reentrant=self.checkpointing)
        return self.head(F.adaptive_avg_pool2d(x, 2))


class LSTMLM(nn.Module):
    """Embedding, a 2-layer LSTM, a vocabulary head: next-token prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lstm = nn.LSTM(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.checkpointing: bool | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.checkpointing is None:
            h = self.lstm(h)[0]
        else:
            h = checkpoint(lambda t: self.lstm(t)[0], h, use_reentrant=self.checkpointing)
        return self.head(h)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TiedLM(nn.Module):
    """A small LM whose output projection is its input embedding (one parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(HIDDEN), Block(HIDDEN)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.checkpointing: bool | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h) if self.checkpointing is None else checkpoint(
                block, h, use_reentrant=self.checkpointing)
        return self.head(self.norm(h))


class Adapter(nn.Module):
    def __init__(self, width: int, rank: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, rank, bias=False)
        self.b = nn.Linear(rank, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(h))


class AdapterNet(nn.Module):
    """A frozen base (an MLP with a LayerNorm) with trainable low-rank adapters."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 32)
        for p in self.parameters():
            p.requires_grad_(False)
        self.adapter1 = Adapter(64)
        self.adapter2 = Adapter(64)
        self.checkpointing: bool | None = None

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.mid(h) + self.adapter1(h))
        return self.norm(h + self.adapter2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        if self.checkpointing is None:
            h = self._middle(h)
        else:  # the frozen base gives no grad-requiring input: HF's input_require_grads
            h = checkpoint(self._middle, h.requires_grad_(True) if self.checkpointing else h,
                           use_reentrant=self.checkpointing)
        return self.out(h)


def parametrized_sequential() -> nn.Module:
    """torch's own module machinery, whose parametrizations O2 computes from the fp32
    truth: an ``nn.Sequential`` whose Linears carry the orthogonal, weight-norm and
    spectral-norm parametrizations (the new API) and the legacy spectral-norm hook."""
    from torch.nn.utils import parametrizations as P

    return nn.Sequential(
        P.orthogonal(nn.Linear(32, 32)), nn.ReLU(),
        P.weight_norm(nn.Linear(32, 64)), nn.GELU(),
        nn.Linear(64, 64), nn.GELU(),
        P.spectral_norm(nn.Linear(64, 32)), nn.Tanh(),
        torch.nn.utils.spectral_norm(nn.Linear(32, 32)))


class SparseEmbeddingNet(nn.Module):
    """A bag of sparse-gradient embeddings and a small head: O2 must train them with
    sparse fp32 gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, HIDDEN, mode="mean", sparse=True)
        self.hidden = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                    nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.head = nn.Linear(HIDDEN, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.embed(ids)))


def _hf_config(kind: str) -> Any:
    import transformers as hf

    common = {"vocab_size": VOCAB, "attn_implementation": "eager"}
    if kind == "llama":
        return hf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2,
                              max_position_embeddings=64, initializer_range=0.2,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, **common)
    if kind == "gpt2":
        return hf.GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=64,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0, **common)
    if kind == "bert":
        return hf.BertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64, num_labels=4,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             initializer_range=0.2, pad_token_id=0, **common)
    return hf.T5Config(d_model=HIDDEN, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                       dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                       eos_token_id=1, initializer_factor=1.0, **common)


def _hf_model(kind: str) -> nn.Module:
    import transformers as hf

    cls = {"llama": hf.LlamaForCausalLM, "gpt2": hf.GPT2LMHeadModel,
           "bert": hf.BertForSequenceClassification,
           "t5": hf.T5ForConditionalGeneration}[kind]
    return cls(_hf_config(kind)).train()


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    hf: bool = False
    decoder: bool = False  # has generate()
    #: fp8 tensorwise has Linear-like layers to convert (else it must refuse)
    fp8_layers: bool = True
    #: torch.compile(fullgraph=True) is possible (dynamo does not trace nn.LSTM)
    fullgraph: bool = True
    #: the machinery it is crossed with (None: all)
    machinery: tuple[str, ...] | None = None
    #: its training loss, where :func:`loss_of` has no rule for it (model, batch)
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None


def _ids(g: torch.Generator, n: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, seq), generator=g)


def _lm_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids}


ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("llama", lambda: _hf_model("llama"), _lm_batch, hf=True, decoder=True),
    Arch("gpt2", lambda: _hf_model("gpt2"), _lm_batch, hf=True, decoder=True),
    Arch("bert", lambda: _hf_model("bert"),
         lambda g: {"input_ids": _ids(g), "labels": torch.randint(0, 4, (BATCH,), generator=g)},
         hf=True),
    Arch("t5", lambda: _hf_model("t5"),
         lambda g: {"input_ids": _ids(g), "labels": _ids(g)}, hf=True, decoder=True),
    Arch("cnn_batchnorm", CNN,
         lambda g: {"x": torch.randn(16, 3, 8, 8, generator=g),
                    "y": torch.randint(0, 10, (16,), generator=g)}),
    Arch("lstm", LSTMLM, lambda g: {"x": _ids(g), "y": _ids(g)}, fp8_layers=False,
         fullgraph=False),
    Arch("tied_embeddings", TiedLM, lambda g: {"x": _ids(g), "y": _ids(g)}),
    Arch("parametrized_sequential", parametrized_sequential,
         lambda g: {"x": torch.randn(16, 32, generator=g),
                    "y": torch.randn(16, 32, generator=g)}),
    # sparse gradients: SGD (AdamW refuses them); crossed with the basic machinery only
    Arch("sparse_embedding", SparseEmbeddingNet,
         lambda g: {"x": _ids(g, 16), "y": torch.randint(0, 16, (16,), generator=g)},
         machinery=("plain_steps", "grad_accumulation", "state_dict_resume",
                    "data_edit_between_steps", "dtype_invariants")),
    Arch("frozen_base_adapters", AdapterNet,
         lambda g: {"x": torch.randn(16, 32, generator=g),
                    "y": torch.randn(16, 32, generator=g)}),
)}

_PRISTINE: dict[str, nn.Module] = {}


def fresh(arch: str) -> nn.Module:
    """A new fp32 model of ``arch``, always the same weights (built once per process)."""
    if arch not in _PRISTINE:
        torch.manual_seed(1234)
        _PRISTINE[arch] = ARCHS[arch].build()
    return copy.deepcopy(_PRISTINE[arch])


def batch(arch: str, step: int) -> dict[str, torch.Tensor]:
    return ARCHS[arch].batch(torch.Generator().manual_seed(1000 + step))


def loss_of(arch: str, model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss, always in fp32 (HF computes it from ``logits.float()``)."""
    own = ARCHS[arch].loss
    if own is not None:
        return own(model, data)
    if ARCHS[arch].hf:
        return model(**data).loss.float()
    out = model(data["x"]).float()
    if arch in ("frozen_base_adapters", "parametrized_sequential"):
        return F.mse_loss(out, data["y"])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), data["y"].reshape(-1))


def enable_checkpointing(arch: str, model: nn.Module, reentrant: bool) -> None:
    if ARCHS[arch].hf:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    elif isinstance(model, nn.Sequential):  # checkpoint each Linear with what follows
        model.forward = _sequential_checkpointed(model, reentrant)  # type: ignore[method-assign]
    else:
        model.checkpointing = reentrant


def _sequential_checkpointed(model: nn.Sequential, reentrant: bool) -> Callable[..., Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        layers = list(model)
        for i in range(0, len(layers) - 1, 2):
            pair = nn.Sequential(*layers[i:i + 2])
            x = checkpoint(pair, x.requires_grad_(True) if reentrant else x,
                           use_reentrant=reentrant)
        return layers[-1](x)
    return forward


# --------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A model and optimizer set up in a mode, with the mode's way to run a step."""

    model: nn.Module
    opt: torch.optim.Optimizer
    forward_ctx: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    scaler: Any = None
    backward_fn: Callable[[torch.Tensor], None] | None = None
    unscale_fn: Callable[[], None] | None = None
    on_close: Callable[[], None] = lambda: None
    closed: bool = False

    def close(self) -> None:
        """Undo what the mode opened for the thread (MXNet's region); once."""
        if not self.closed:
            self.closed = True
            self.on_close()

    def backward(self, loss: torch.Tensor) -> None:
        if self.backward_fn is not None:
            self.backward_fn(loss)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self) -> None:
        if self.unscale_fn is not None:
            self.unscale_fn()
        elif self.scaler is not None:
            self.scaler.unscale_(self.opt)

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(model, SparseEmbeddingNet):  # AdamW takes no sparse gradients
        return torch.optim.SGD(params, lr=LR * 10)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _initialize(**kwargs: Any) -> Callable[[nn.Module, torch.optim.Optimizer], Run]:
    def setup(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
        import ampkit

        model, opt = ampkit.initialize(model, opt, **kwargs)
        return Run(model, opt)
    return setup


def _with_scaler(**kwargs: Any) -> Callable[[nn.Module, torch.optim.Optimizer], Run]:
    def setup(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
        import ampkit

        model, opt = ampkit.initialize(model, opt, **kwargs)
        # 2**8: no overflow in the first steps, so no skipped step hides in the losses
        return Run(model, opt, scaler=ampkit.GradScaler("cpu", init_scale=2.0**8))
    return setup


def _native(dtype: torch.dtype) -> Callable[[nn.Module, torch.optim.Optimizer], Run]:
    def setup(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if dtype == FP16 else None
        return Run(model, opt, forward_ctx=lambda: torch.autocast("cpu", dtype), scaler=scaler)
    return setup


def _fp32(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
    return Run(model, opt)


def _apex(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
    from ampkit import apex as amp

    model, opt = amp.initialize(model, opt)  # apex's default: opt_level="O1", fp16

    def backward(loss: torch.Tensor) -> None:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    # apex's O1 keeps its handle (and the in-place refusals it patches into torch) for
    # the whole process, as apex does; the cell's run ends it, so that later tests in
    # the same process do not run under apex's lists.
    return Run(model, opt, backward_fn=backward, on_close=amp._amp_state.handle._deactivate)


def _paddle(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
    from ampkit import paddle

    # Paddle's defaults: auto_cast(level="O1", dtype="float16"), GradScaler()
    return Run(model, opt, forward_ctx=paddle.auto_cast,
               scaler=paddle.GradScaler(init_loss_scaling=2.0**8))


def _mindspore(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
    from ampkit import mindspore

    return Run(mindspore.auto_mixed_precision(model), opt)  # default amp_level="O0"


def _mxnet(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
    from ampkit import mxnet as amp

    amp.init()  # default target_dtype="float16": a region kept open in this thread
    amp.init_trainer(opt)

    def backward(loss: torch.Tensor) -> None:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    return Run(model, opt, backward_fn=backward, unscale_fn=lambda: amp.unscale(opt),
               on_close=amp.deinit)


def _torch_dialect(model: nn.Module, opt: torch.optim.Optimizer) -> Run:
    import ampkit.torch as amp

    return Run(model, opt, forward_ctx=lambda: amp.autocast("cpu"))  # default dtype: bf16


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    setup: Callable[[nn.Module, torch.optim.Optimizer], Run]
    tolerance: str
    #: the reference it must equal bit for bit ("native_bf16"/"native_fp16"/"fp32"), if any
    bit_equal_to: str | None = None
    #: where the truth lives: "fp32" or "low" (O3, pure): which dtypes parameters keep
    truth: str = "fp32"
    #: runs native's fp32 list in fp32 (the O1/O2 family); O3 is low precision by design
    keeps_fp32_ops: bool = True
    low: torch.dtype = BF16
    dialect: bool = False
    fp8: bool = False
    #: opens a region for the whole thread (MXNet's init): one run at a time
    thread_region: bool = False
    #: computes inside native torch.autocast at ``low`` (the O1 family, the autocast
    #: dialects): where native autocast cannot run an architecture on this CPU, nor can it
    native_region: bool = False


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("O0", _initialize(level="O0"), "fp32", bit_equal_to="fp32", keeps_fp32_ops=False),
    Mode("O1_bf16", _initialize(level="O1", dtype=BF16), "bf16", bit_equal_to="native_bf16",
         native_region=True),
    Mode("O1_fp16_scaler", _with_scaler(level="O1", dtype=FP16), "fp16",
         bit_equal_to="native_fp16", low=FP16, native_region=True),
    # keeps_fp32_ops=False: the user's lists decide (a white-listed add makes GPT-2's
    # masked scores, and so its softmax, bf16, as the user asked)
    Mode("O1_custom_policy", _initialize(level="O1", dtype=BF16, custom_white_list=["add"],
                                         custom_black_list=["bmm"]), "bf16",
         keeps_fp32_ops=False, native_region=True),
    Mode("O2_bf16", _initialize(level="O2", dtype=BF16), "bf16"),
    Mode("O2_fp16_scaler", _with_scaler(level="O2", dtype=FP16), "fp16", low=FP16),
    Mode("O3_bf16", _initialize(level="O3", dtype=BF16), "bf16_weights", truth="low",
         keeps_fp32_ops=False),
    Mode("pure_bf16_stochastic", _initialize(level="O2", dtype=BF16,
                                             master_weights="stochastic", rounding_seed=0),
         "bf16_weights", truth="low"),
    Mode("pure_bf16_kahan", _initialize(level="O2", dtype=BF16, master_weights="kahan",
                                        rounding_seed=0), "bf16_weights", truth="low"),
    Mode("fp8_tensorwise", _initialize(level="O2", dtype=BF16, fp8="tensorwise"), "fp8",
         fp8=True),
    # each dialect's default level, for one model each (DIALECT_ARCH)
    Mode("apex_default_O1", _apex, "fp16", low=FP16, dialect=True, native_region=True),
    Mode("paddle_default_O1", _paddle, "fp16", low=FP16, dialect=True, native_region=True),
    Mode("mindspore_default_O0", _mindspore, "fp32", bit_equal_to="fp32", dialect=True,
         keeps_fp32_ops=False),
    Mode("mxnet_default_fp16", _mxnet, "fp16", low=FP16, dialect=True, thread_region=True),
    Mode("torch_default_autocast", _torch_dialect, "bf16", bit_equal_to="native_bf16",
         dialect=True, native_region=True),
)}
REFERENCES: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Run]] = {
    "fp32": _fp32, "native_bf16": _native(BF16), "native_fp16": _native(FP16)}
DIALECT_ARCH = {"apex_default_O1": "cnn_batchnorm", "paddle_default_O1": "bert",
                "mindspore_default_O0": "lstm", "mxnet_default_fp16": "frozen_base_adapters",
                "torch_default_autocast": "llama"}


def setup(arch: str, mode: str, *, prepare: Callable[[nn.Module], None] | None = None) -> Run:
    model = fresh(arch)
    if prepare is not None:
        prepare(model)
    opt = make_optimizer(model)
    factory = REFERENCES[mode] if mode in REFERENCES else MODES[mode].setup
    run = factory(model, opt)
    OPEN_RUNS.append(run)
    return run


#: every run set up since the last :func:`close_all` (the test module closes them after
#: each cell, so a thread-wide region never outlives its cell, even one that failed)
OPEN_RUNS: list[Run] = []


def close_all() -> None:
    while OPEN_RUNS:
        OPEN_RUNS.pop().close()


# --------------------------------------------------------------------------------------
# Machinery: each returns the numbers its cell compares (losses, mostly)
# --------------------------------------------------------------------------------------


def _train_step(arch: str, run: Run, step: int, micro: int = 1,
                clip: float | None = None) -> float:
    total = 0.0
    for m in range(micro):
        with run.forward_ctx():
            loss = loss_of(arch, run.model, batch(arch, 10 * step + m))
        run.backward(loss / micro)
        total += loss.item() / micro
    if clip is not None:
        run.unscale()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    run.step()
    return total


def _eval(arch: str, run: Run, model: nn.Module | None = None,
          grad_mode: Callable[[], Any] = torch.no_grad) -> float:
    model = run.model if model is None else model
    with grad_mode(), run.forward_ctx():
        return loss_of(arch, model, batch(arch, 99)).item()


def m_plain(arch: str, mode: str) -> list[float]:
    run = setup(arch, mode)
    try:
        return [_train_step(arch, run, s) for s in range(STEPS)]
    finally:
        run.close()


def m_grad_accumulation(arch: str, mode: str) -> list[float]:
    run = setup(arch, mode)
    try:
        return [_train_step(arch, run, s, micro=2) for s in range(2)]
    finally:
        run.close()


def m_clipping(arch: str, mode: str) -> list[float]:
    run = setup(arch, mode)
    try:
        return [_train_step(arch, run, s, clip=0.05) for s in range(STEPS)]
    finally:
        run.close()


def m_compile(arch: str, mode: str) -> list[float]:
    run = setup(arch, mode)
    # aot_eager: dynamo and AOT autograd trace ampkit's regions and casts, as with
    # inductor, without minutes of C++ code generation per cell on a CPU
    # fullgraph for the architectures written here (one graph each, custom lists too);
    # HF's models break graphs on purpose (their loss and output classes), and dynamo
    # does not trace nn.LSTM (a graph break around it)
    run.model = torch.compile(run.model, backend="aot_eager",
                              fullgraph=not ARCHS[arch].hf and ARCHS[arch].fullgraph)
    try:
        return [_train_step(arch, run, s) for s in range(STEPS)]
    finally:
        torch._dynamo.reset()
        run.close()


def _checkpointed(reentrant: bool) -> Callable[[str, str], list[float]]:
    def machinery(arch: str, mode: str) -> list[float]:
        run = setup(arch, mode, prepare=lambda m: enable_checkpointing(arch, m, reentrant))
        try:
            return [_train_step(arch, run, s) for s in range(STEPS)]
        finally:
            run.close()
    return machinery


def _resume(how: str) -> Callable[[str, str], list[float]]:
    """Two steps, then the model and optimizer move by ``how`` into another object, which
    trains two more; the losses must be the uninterrupted run's, bit for bit."""

    def machinery(arch: str, mode: str) -> list[float]:
        run = setup(arch, mode)
        losses = [_train_step(arch, run, s) for s in range(2)]
        if how == "state_dict":
            other = setup(arch, mode)
            other.model.load_state_dict(run.model.state_dict())
            other.opt.load_state_dict(run.opt.state_dict())
            if run.scaler is not None:
                other.scaler.load_state_dict(run.scaler.state_dict())
        elif how == "torch_save":
            buffer = io.BytesIO()
            torch.save({"model": run.model, "opt": run.opt, "scaler": run.scaler}, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            other = dataclasses.replace(run, model=loaded["model"], opt=loaded["opt"],
                                        scaler=loaded["scaler"])
        else:
            model, opt, scaler = copy.deepcopy((run.model, run.opt, run.scaler))
            other = dataclasses.replace(run, model=model, opt=opt, scaler=scaler)
        del run
        return losses + [_train_step(arch, other, s) for s in range(2, 4)]
    return machinery


def m_uninterrupted(arch: str, mode: str) -> list[float]:
    run = setup(arch, mode)
    return [_train_step(arch, run, s) for s in range(4)]


def m_ema(arch: str, mode: str) -> list[float]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    run = setup(arch, mode)
    ema = AveragedModel(run.model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    losses = []
    for s in range(STEPS):
        losses.append(_train_step(arch, run, s))
        ema.update_parameters(run.model)
        losses.append(_eval(arch, run, ema.module))
    return losses


class Values(list):  # type: ignore[type-arg]
    """A cell's numbers; ``twin`` holds what a freshly set-up copy computed, where the
    cell has one (bit for bit the same by design)."""

    twin: list[float]


def _fresh_twin_loss(arch: str, mode: str, run: Run, step: int, train: bool) -> float:
    """The loss a model newly set up in ``mode`` from ``run.model``'s current state
    computes: no low-precision copy can be stale in it."""
    if mode in MODES and MODES[mode].thread_region:  # share the thread's region
        twin = Run(fresh(arch), run.opt, forward_ctx=run.forward_ctx)
    else:
        twin = setup(arch, mode)
    try:
        twin.model.load_state_dict(run.model.state_dict())
        twin.model.train(train)
        # the run's own grad mode: some kernels (oneDNN's LSTM) differ between the two
        with torch.set_grad_enabled(train), twin.forward_ctx():
            return loss_of(arch, twin.model, batch(arch, step)).item()
    finally:
        twin.close()


def m_data_edit(arch: str, mode: str) -> list[float]:
    """The routes by which weights change between forwards, none of which O2's copies may
    miss: an optimizer step; an eval; every weight edited through ``.data`` (in place for
    half, a new tensor for the other half); two steps of a hand-written sign-SGD through
    ``.data`` (no optimizer step in between); and, after
    an eval, the initial weights copied back in through ``.data`` (the EMA-swap pattern);
    ``load_state_dict`` of halved weights; the parameters made views of one flat vector
    (``vector_to_parameters``) and the vector scaled in place. fp32
    training sees each edit in the next forward; so must the mode: each forward after
    an edit equals, bit for bit, that of a model newly set up from the edited state."""
    run = setup(arch, mode)
    losses, twin = Values([_train_step(arch, run, 0)]), []
    losses.append(_eval(arch, run))
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    with torch.no_grad():
        for i, p in enumerate(trainable):
            if i % 2:
                p.data.mul_(0.5)
            else:
                p.data = p.data * 0.5
    for s in (1, 2):
        twin.append(_fresh_twin_loss(arch, mode, run, s, train=True))
        with run.forward_ctx():
            loss = loss_of(arch, run.model, batch(arch, s))
        run.backward(loss)
        losses.append(loss.item())
        for p in trainable:
            if p.grad is not None:
                p.data.add_(p.grad.sign().to(p.dtype), alpha=-0.05)
                p.grad = None
    run.model.eval()
    twin.append(_fresh_twin_loss(arch, mode, run, 99, train=False))
    losses.append(_eval(arch, run))
    originals = [p for p in fresh(arch).parameters() if p.requires_grad]
    for p, original in zip(trainable, originals):  # other weights swapped in wholesale
        p.data.copy_(original.to(p.dtype))
    twin.append(_fresh_twin_loss(arch, mode, run, 99, train=False))
    losses.append(_eval(arch, run))
    # load_state_dict of halved weights (no .data, a route of its own)
    run.model.load_state_dict({k: v * 0.5 if v.is_floating_point() else v
                               for k, v in run.model.state_dict().items()})
    twin.append(_fresh_twin_loss(arch, mode, run, 99, train=False))
    losses.append(_eval(arch, run))
    # parameters made views of one flat vector, then the vector edited in place
    with torch.no_grad():  # one vector per dtype (pure bf16 keeps its norms fp32)
        for dtype in {p.dtype for p in trainable}:
            group = [p for p in trainable if p.dtype == dtype]
            flat = torch.nn.utils.parameters_to_vector(group)
            torch.nn.utils.vector_to_parameters(flat, group)
            flat.mul_(3.0)
    twin.append(_fresh_twin_loss(arch, mode, run, 99, train=False))
    losses.append(_eval(arch, run))
    losses.twin = twin
    run.close()
    return losses


def m_eval_between_steps(arch: str, mode: str) -> list[float]:
    run = setup(arch, mode)
    losses = []
    for s, grad_mode in enumerate((torch.no_grad, torch.inference_mode, torch.no_grad)):
        losses.append(_train_step(arch, run, s))
        run.model.eval()
        losses.append(_eval(arch, run, grad_mode=grad_mode))
        run.model.train()
    return losses


def m_generate(arch: str, mode: str) -> list[float]:
    """One training step, then greedy ``generate()``: the first token's scores, and the
    model still trains afterwards."""
    run = setup(arch, mode)
    losses = [_train_step(arch, run, 0)]
    run.model.eval()
    ids = batch(arch, 50)["input_ids"][:, :4]
    with torch.no_grad(), run.forward_ctx():
        out = run.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=3, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
    run.model.train()
    scores = out.scores[0].float()
    losses += [scores.abs().max().item(), scores.abs().mean().item(),
               float(out.sequences.shape[1])]
    losses.append(_train_step(arch, run, 1))
    return losses


MACHINERY: dict[str, Callable[[str, str], list[float]]] = {
    "plain_steps": m_plain,
    "grad_accumulation": m_grad_accumulation,
    "clip_grad_norm": m_clipping,
    "torch_compile": m_compile,
    "checkpoint_reentrant": _checkpointed(True),
    "checkpoint_non_reentrant": _checkpointed(False),
    "state_dict_resume": _resume("state_dict"),
    "torch_save_load_resume": _resume("torch_save"),
    "deepcopy_resume": _resume("deepcopy"),
    "ema_model": m_ema,
    "data_edit_between_steps": m_data_edit,
    "eval_no_grad_inference_mode_between_steps": m_eval_between_steps,
    "generate": m_generate,
}
#: machinery whose reference is the same mode, uninterrupted, bit for bit
RESUMES = ("state_dict_resume", "torch_save_load_resume", "deepcopy_resume")

_CACHE: dict[tuple[str, str, str], list[float]] = {}


def reference(arch: str, ref_mode: str, machinery: str) -> list[float]:
    key = (arch, ref_mode, machinery)
    if key not in _CACHE:
        fn = m_uninterrupted if machinery in RESUMES else MACHINERY[machinery]
        _CACHE[key] = fn(arch, ref_mode)
    return _CACHE[key]


# --------------------------------------------------------------------------------------
# Dtype invariants
# --------------------------------------------------------------------------------------

#: aten ops the dtype check follows: native autocast runs each in fp32 wherever it runs it
#: so (the device's fp32 list: losses; and softmax whenever its input is fp32)
WATCHED_OPS = ("_softmax", "_log_softmax", "nll_loss_forward", "nll_loss2d_forward",
               "mse_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits")
NORM_OPS = ("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
            "_native_batch_norm_legit_no_training", "native_group_norm")


class OpDtypes(TorchDispatchMode):
    """Counts, per watched aten op, the calls that produced fp32; and the dtypes of the
    weights the norm kernels received."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.norm_weights: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in WATCHED_OPS:
            first = out[0] if isinstance(out, tuple) else out
            self.calls[name] += 1
            self.fp32[name] += first.dtype == torch.float32
        elif name in NORM_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
            self.norm_weights.add(args[1].dtype)
        return out


def observe_ops(arch: str, run: Run) -> OpDtypes:
    with OpDtypes() as seen, run.forward_ctx():
        loss = loss_of(arch, run.model, batch(arch, 7))
    loss.backward()
    run.opt.zero_grad(set_to_none=True)
    return seen


def floating_buffers(model: nn.Module) -> dict[str, torch.dtype]:
    return {n: b.dtype for n, b in model.named_buffers() if b.is_floating_point()}


def is_norm(module: nn.Module) -> bool:
    """The norms the README's level table speaks of: torch's BatchNorm, LayerNorm,
    GroupNorm, InstanceNorm and RMSNorm classes (HF's own ``LlamaRMSNorm`` and
    ``T5LayerNorm`` are plain modules to ampkit, and to this check)."""
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)
    return isinstance(module, norms)


def norm_parameter_names(model: nn.Module) -> set[str]:
    return {f"{m}.{p}".lstrip(".") for m, mod in model.named_modules() if is_norm(mod)
            for p, _ in mod.named_parameters(recurse=False)}


@contextlib.contextmanager
def closing(run: Run) -> Iterator[Run]:
    try:
        yield run
    finally:
        run.close()
