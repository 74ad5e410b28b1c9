"""One O2 model, two threads: a training thread and a serving thread (predictions under
``no_grad``), the pattern of evaluating or serving while fine-tuning.

At O2 a module's forward puts low-precision copies of its parameters in the module's
own ``_parameters``, which both threads share. A forward entered while another thread
is inside the same module is refused (``RuntimeError`` naming the rule and what to do);
nothing else changes, so a training loop that retries a refused step trains exactly as
a single thread does, and a read of the parameters from either thread gives the fp32
truth. Oracle: the same training run on one thread, grads and parameters bit for bit;
the serving thread's predictions against a plain ``no_grad`` forward of the same model.

A *gate* makes the overlap deterministic: a layer whose forward, on the serving
thread, waits inside (its copies swapped in) until the test lets it go."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

BF16 = torch.bfloat16


class _Gate(nn.Linear):
    """A Linear that holds the thread named ``serving`` inside its forward (after the
    cast: its copies are in place) until ``release`` is set."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.inside = threading.Event()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "serving" and not self.release.is_set():
            self.inside.set()
            assert self.release.wait(30)
        return super().forward(x)


def _model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), _Gate(width), nn.ReLU(),
                        nn.Linear(width, 4))
    return ampkit.initialize(net, level="O2", dtype="bfloat16")


def _batches(n: int, width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, width, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _train(model: nn.Module, batches, on_refused=None):
    """SGD over ``batches``; each step's grads and the final parameters. A refused
    forward (another thread inside a module) is retried after ``on_refused()``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, y in batches:
        while True:
            try:
                loss = F.cross_entropy(model(x), y)
                break
            except RuntimeError as e:
                if on_refused is None or "two threads" not in str(e):
                    raise
                on_refused()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


def _serving_thread(model: nn.Module, x: torch.Tensor, out: dict) -> threading.Thread:
    def serve() -> None:
        try:
            with torch.no_grad():
                out["y"] = model(x)
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    return threading.Thread(target=serve, name="serving")


def _assert_same(a, b) -> None:
    for ga, gb in zip(a, b, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True)) if isinstance(
            ga, list) else torch.equal(ga, gb)


def test_training_forward_while_serving_inside_is_refused_then_trains_as_one_thread():
    batches = _batches(3)
    ref_grads, ref_params = _train(_model(), batches)

    model = _model()
    gate = model[2]
    x_serve = torch.randn(4, 16)
    with torch.no_grad():
        gate.release.set()
        expected = model(x_serve)  # the serving thread's prediction, on its own
        gate.release.clear()
    out: dict = {}
    serving = _serving_thread(model, x_serve, out)
    serving.start()
    assert gate.inside.wait(30)
    # The serving thread is inside the gate with its copies in place: the training
    # forward reaches the gate and is refused, naming the rule and the way out.
    with pytest.raises(RuntimeError, match=r"two threads.*_parameters.*copy\.deepcopy"
                       r".*O1") as refused:
        model(batches[0][0])
    assert "'_Gate'" in str(refused.value) and "'serving'" in str(refused.value)
    # The refusal touched nothing: no grads, parameters back in every module.
    assert all(p.grad is None for p in model.parameters())
    gate.release.set()
    serving.join(30)
    assert "error" not in out
    assert torch.equal(out["y"], expected)
    grads, params = _train(model, batches)
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)


def test_serving_forward_while_training_inside_is_refused():
    # The other order: the training thread is inside a layer (its copies, with autograd
    # history, in place); the serving forward reaching that layer is refused, and the
    # training forward's graph is intact.
    inside, release = threading.Event(), threading.Event()

    class _Hold(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if threading.current_thread().name == "training":
                inside.set()
                assert release.wait(30)
            return super().forward(x)

    torch.manual_seed(0)
    model = ampkit.initialize(nn.Sequential(nn.Linear(16, 16), _Hold(16, 16)), level="O2",
                              dtype="bfloat16")
    x = torch.randn(2, 16)
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.__setitem__("y", model(x)),
                               name="training")
    trainer.start()
    assert inside.wait(30)
    out: dict = {}
    serving = _serving_thread(model, torch.randn(2, 16), out)
    serving.start()
    serving.join(30)
    release.set()
    trainer.join(30)
    assert isinstance(out.get("error"), RuntimeError)
    assert "two threads" in str(out["error"]) and "'training'" in str(out["error"])
    # The training forward equals one run alone, and its backward reaches every weight
    # as one run alone does.
    result["y"].square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    release.set()
    alone = model(x)
    assert torch.equal(alone, result["y"])
    alone.square().sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(),
                                                        strict=True))


def test_parameters_and_state_dict_read_from_another_thread_give_the_truth():
    # While the serving thread is inside the gate (its copies in the gate's
    # _parameters), the training thread reads the model: clip_grad_norm_ over
    # parameters(), a checkpoint with state_dict(). Both must see the fp32 parameters.
    model = _model()
    gate = model[2]
    truth = {n: p for n, p in model.named_parameters()}
    out: dict = {}
    serving = _serving_thread(model, torch.randn(4, 16), out)
    serving.start()
    try:
        assert gate.inside.wait(30)
        assert [(n, id(p)) for n, p in model.named_parameters()] == [
            (n, id(p)) for n, p in truth.items()]
        assert all(a is b for a, b in zip(model.parameters(), truth.values(), strict=True))
        sd = model.state_dict()
        assert all(sd[n].dtype is torch.float32 and torch.equal(sd[n], p.detach())
                   for n, p in truth.items())
        assert model.state_dict(keep_vars=True)["2.weight"] is truth["2.weight"]
        assert model.get_parameter("2.weight") is truth["2.weight"]
    finally:
        gate.release.set()
        serving.join(30)
    assert "error" not in out


def test_training_with_a_serving_thread_trains_as_one_thread():
    # The pattern as users run it, with no gate: a serving thread predicting in a loop
    # while the training thread trains, retrying a refused forward. Bit for bit the
    # single-thread run; every completed prediction is a plain no_grad forward.
    batches = _batches(40)
    ref_grads, ref_params = _train(_model(), batches)
    model = _model()
    model[2].release.set()
    stop = threading.Event()
    refused = {"serving": 0, "training": 0}

    def serve() -> None:
        x = torch.randn(4, 16)
        while not stop.is_set():
            try:
                with torch.no_grad():
                    model(x)
            except RuntimeError as e:
                assert "two threads" in str(e)
                refused["serving"] += 1

    serving = threading.Thread(target=serve, name="serving")
    # (threads switch every 10 us instead of 5 ms: the two forwards overlap in every
    # step, not by chance)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    serving.start()
    try:
        grads, params = _train(model, batches, on_refused=lambda: refused.__setitem__(
            "training", refused["training"] + 1))
    finally:
        stop.set()
        serving.join(30)
        sys.setswitchinterval(interval)
    assert refused["serving"] + refused["training"] > 0  # the threads did meet
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)
