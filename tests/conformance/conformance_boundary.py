"""The conformance matrix's cells for a converted model's boundary: one architecture,
``boundary_probe``, whose forward hands back what the output rule is about, crossed with
every core mode through three pieces of machinery of its own, against fp32 training and
native autocast.

* ``dataclass_float64_output``: the model returns a dataclass whose ``__post_init__``
  scales a field and counts its calls, with a float64 field (values near 1e6, which
  float32 would round) and a ``defaultdict`` inside. Each step checks that the output
  kept its types, that ``__post_init__`` ran once, that float64 stayed float64 and that
  the factory survived; the cell's numbers are the losses and the float64 field's mean.
* ``compiled_fn_output``: the same steps through ``torch.compile`` of the user's step
  function that calls the model (not of the model): the traced output cast (views of
  inputs are not checked there: they are not mapped back in compiled code).
* ``serving_thread``: training while a second thread serves predictions from the same
  model under ``no_grad``, at O2 and O3 (whose second thread waits for a module's
  forward): the losses equal the same mode's on one thread, bit for bit.
* ``inputs_and_hooks``: the model returns its output and a view of its input (a tuple,
  which torch's full backward hooks see into) and has a full backward hook; each step
  checks the view's values are the caller's exactly and the hook's ``grad_input`` is
  the caller's dtype; then a forward that edits its input in place
  must edit the caller's tensor as native autocast does, or be refused naming it (O2
  and O3 cast the inputs: never a silently unedited tensor).

Registered into :mod:`conformance_cells`' tables on import (``test_matrix`` imports it).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import conformance_cells as C
import torch
import torch.nn as nn
import torch.nn.functional as F

#: the machinery only ``boundary_probe`` is crossed with
MACHINERY = ("dataclass_float64_output", "compiled_fn_output", "inputs_and_hooks",
             "serving_thread")
#: the modes whose training beside a serving thread equals one thread's: O2 and O3 hold
#: their copies per module and make a second thread wait. O1 and native autocast share
#: torch's autocast weight-cast cache between threads (a training forward can use a
#: cast another thread made before the optimizer stepped), so theirs is not crossed.
SERVING_MODES = ("O2_bf16", "O3_bf16")


def _missing() -> float:
    return -1.0


@dataclasses.dataclass
class ProbeOut:
    logits: torch.Tensor
    wide: torch.Tensor
    extra: collections.defaultdict  # type: ignore[type-arg]
    echo: torch.Tensor | None = None
    scale: float = 0.5
    calls: int = 0

    def __post_init__(self) -> None:
        # user code that transforms a field: run twice, it would scale twice
        self.logits = self.logits * self.scale
        self.calls += 1


class BoundaryProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(C.HIDDEN, C.HIDDEN)
        self.head = nn.Linear(C.HIDDEN, C.HIDDEN)
        self.edit = False
        self.plain = False  # a tuple, which torch's full backward hooks see into

    def forward(self, x: torch.Tensor) -> Any:
        if self.edit:
            x.add_(1.0)
        h = self.head(F.gelu(self.inp(x)))
        if self.plain:
            return h, x[0]
        wide = h.double() * 1e6 + 1e6
        extra = collections.defaultdict(_missing, hidden=h)
        return ProbeOut(h, wide, extra, echo=x[0])


def _batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(C.BATCH * 4, C.HIDDEN, generator=g),
            "y": torch.randn(C.BATCH * 4, C.HIDDEN, generator=g)}


def _checked(out: Any, x: torch.Tensor, views: bool = True) -> ProbeOut:
    assert type(out) is ProbeOut, f"the output came back as {type(out).__name__}"
    assert out.calls == 1, f"__post_init__ ran {out.calls} times"
    assert out.wide.dtype is torch.float64, f"a float64 output came back {out.wide.dtype}"
    assert type(out.extra) is collections.defaultdict and out.extra["absent"] == -1.0, (
        "a defaultdict output lost its default_factory")
    assert not views or (out.echo is not None and torch.equal(out.echo, x[0])), (
        "a view of the input came back with other values than the caller's")
    return out


def probe_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    out = _checked(model(data["x"]), data["x"])
    return F.mse_loss(out.logits.float(), data["y"]) + 1e-9 * out.wide.mean().float()


def _steps(arch: str, run: C.Run, call: Any, views: bool = True) -> list[float]:
    values = []
    for s in range(C.STEPS):
        data = C.batch(arch, 10 * s)
        with run.forward_ctx():
            out = _checked(call(data["x"]), data["x"], views)
            loss = F.mse_loss(out.logits.float(), data["y"])
        run.backward(loss)
        run.step()
        values += [loss.item(), (out.wide.mean().item() - 1e6) / 1e6]
    return values


def m_dataclass_float64_output(arch: str, mode: str) -> list[float]:
    run = C.setup(arch, mode)
    try:
        return _steps(arch, run, run.model)
    finally:
        run.close()


def m_compiled_fn_output(arch: str, mode: str) -> list[float]:
    run = C.setup(arch, mode)
    model = run.model
    torch._dynamo.reset()
    try:
        # (views of inputs are not mapped back inside compiled code: docs/limits.md)
        return _steps(arch, run, torch.compile(lambda x: model(x), backend="aot_eager"),
                      views=False)
    finally:
        torch._dynamo.reset()
        run.close()


def m_inputs_and_hooks(arch: str, mode: str) -> list[float]:
    run = C.setup(arch, mode)
    grads: list[torch.dtype] = []
    run.model.register_full_backward_hook(lambda m, gi, go: grads.append(gi[0].dtype))
    run.model.plain = True
    try:
        values = []
        for s in range(C.STEPS):
            data = C.batch(arch, 10 * s)
            x = data["x"].requires_grad_()
            with run.forward_ctx():
                logits, echo = run.model(x)
                assert torch.equal(echo, x[0]), (
                    "a view of the input came back with other values than the caller's")
                loss = F.mse_loss(logits.float(), data["y"]) + echo.float().sum()
            run.backward(loss)
            run.step()
            values.append(loss.item())
        assert grads == [torch.float32] * C.STEPS, (
            f"the model's full backward hook got grad_input {grads}; the caller's "
            f"tensors are float32")
        run.model.edit = True
        x = C.batch(arch, 99)["x"]
        before = x.clone()
        try:
            with torch.no_grad(), run.forward_ctx():
                run.model(x)
        except RuntimeError as error:
            assert "edited its input 'x' in place" in str(error), str(error)
        else:
            assert torch.equal(x, before + 1.0), (
                "an in-place edit of the input inside the forward did not reach the "
                "caller's tensor, and was not refused")
        run.model.edit = False
        return values
    finally:
        run.close()


def m_serving_thread(arch: str, mode: str) -> list[float]:
    """Training while another thread serves predictions from the same model under
    ``no_grad``: the losses must be the same mode's on one thread, bit for bit."""
    alone = C.m_plain(arch, mode)
    run = C.setup(arch, mode)
    stop, served, errors = threading.Event(), [0], []
    data = C.batch(arch, 99)

    def serve() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad(), run.forward_ctx():
                    run.model(data["x"])
            except BaseException as error:  # reported to the training thread below
                errors.append(error)
                return
            served[0] += 1

    server = threading.Thread(target=serve, name="server", daemon=True)
    server.start()
    try:
        values = [C._train_step(arch, run, s) for s in range(C.STEPS)]
    finally:
        stop.set()
        server.join(60)
        run.close()
    assert not server.is_alive(), "the serving thread did not stop within 60 s"
    assert not errors, f"the serving thread raised {errors[0]!r}"
    assert served[0] > 0, "the serving thread served nothing while the training ran"
    assert values == alone, (
        f"{mode}: training beside a serving thread {values} != the same training on one "
        f"thread {alone}")
    return values


C.ARCHS["boundary_probe"] = C.Arch(
    "boundary_probe", BoundaryProbe, _batch, loss=probe_loss, fp8_layers=False,
    machinery=("plain_steps", *MACHINERY, "dtype_invariants"))
C.MACHINERY["dataclass_float64_output"] = m_dataclass_float64_output
C.MACHINERY["compiled_fn_output"] = m_compiled_fn_output
C.MACHINERY["inputs_and_hooks"] = m_inputs_and_hooks
C.MACHINERY["serving_thread"] = m_serving_thread
