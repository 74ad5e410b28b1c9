"""One O2 model, two threads: a training thread and a serving thread (predictions under
``no_grad``), the pattern of evaluating or serving while fine-tuning; a thread loading a
state_dict while another predicts; a compiled model beside another thread's compile.

At O2 a module's forward puts low-precision copies of its parameters in the module's
own ``_parameters``, which both threads share. A forward entered while another thread
is inside the same module waits until that forward is done, so each forward computes
with its own copies and the run trains as one thread does; a wait that could never end
(the threads waiting for each other) is refused with ``RuntimeError`` naming the rule.
Oracle: the same training run on one thread, grads and parameters bit for bit; the
values a load put in, read back as the fp32 parameters.

A *gate* makes the overlap deterministic: a layer whose forward, on one thread, stays
inside (its copies swapped in) until the test lets it go."""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import threading
import time

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
        # spin: hold the thread busy (as a long forward does) rather than blocked in
        # Event.wait (a holder blocked in a wait may be waiting for the waiter)
        self.spin = False
        self.log: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        me = threading.current_thread().name
        if me == "serving" and not self.release.is_set():
            self.inside.set()
            if self.spin:
                deadline = time.monotonic() + 30
                while not self.release.is_set() and time.monotonic() < deadline:
                    time.sleep(0.001)
            else:
                assert self.release.wait(30)
        self.log.append(me)
        return super().forward(x)

    def __getstate__(self) -> dict:
        # (a copy gets events of its own, released: its forward holds no thread)
        state = super().__getstate__()
        del state["inside"], state["release"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.inside, self.release = threading.Event(), threading.Event()
        self.release.set()


def _model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), _Gate(width), nn.ReLU(),
                        nn.Linear(width, 4))
    return ampkit.initialize(net, level="O2", dtype="bfloat16")


def _batches(n: int, width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, width, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _train(model: nn.Module, batches, on_refused=None, after_first_forward=None):
    """SGD over ``batches``; each step's grads and the final parameters. A refused
    forward (another thread inside a module) is retried after ``on_refused()``;
    ``after_first_forward()`` runs before the first step's backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for i, (x, y) in enumerate(batches):
        while True:
            try:
                loss = F.cross_entropy(model(x), y)
                break
            except RuntimeError as e:
                if on_refused is None or "two threads" not in str(e):
                    raise
                on_refused()
        if i == 0 and after_first_forward is not None:
            after_first_forward()
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


# Whether this torch holds is_compiling()'s flag up for a whole compile session, for
# every thread (from 2.13: dynamo's convert_frame sets it).
_SESSION_FLAG = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13)


@contextlib.contextmanager
def _compiling_elsewhere():
    """A third thread inside a torch.compile session (its backend held open) for the
    block: from torch 2.13, torch.compiler.is_compiling() is a flag of the whole
    process, set then (2.11 and 2.12 answer True only in what dynamo traces: there the
    eager forwards see it False, and must act the same)."""
    entered, release = threading.Event(), threading.Event()

    def backend(gm, example_inputs):
        entered.set()
        assert release.wait(60)
        return gm

    thread = threading.Thread(target=lambda: torch.compile(
        lambda t: t * 2, backend=backend)(torch.ones(3)), name="compiling")
    thread.start()
    try:
        assert entered.wait(60)
        # (seen from this thread too, where torch sets the flag for the whole session)
        assert torch.compiler.is_compiling() is _SESSION_FLAG
        yield
    finally:
        release.set()
        thread.join(60)


@pytest.mark.parametrize("compiling_elsewhere", [False, True])
def test_training_forward_waits_for_the_serving_forward_then_trains_as_one_thread(
        compiling_elsewhere):
    # The serving thread is inside the gate with its copies in place, busy. The training
    # forward reaching the gate waits (no refusal) until the serving forward has left
    # it, then computes with its own copies: the run equals one thread's. So too while
    # a third thread compiles something (torch's is_compiling() flag is then set for
    # every thread: the eager forwards must not take themselves for traced).
    batches = _batches(3)
    ref_grads, ref_params = _train(_model(), batches)

    model = _model()
    gate = model[2]
    gate.spin = True
    x_serve = torch.randn(4, 16)
    with torch.no_grad():
        gate.release.set()
        expected = model(x_serve)  # the serving thread's prediction, on its own
        gate.release.clear()
    gate.log.clear()
    out: dict = {}
    serving = _serving_thread(model, x_serve, out)
    serving.start()
    assert gate.inside.wait(30)
    timer = threading.Timer(0.3, gate.release.set)
    try:
        with _compiling_elsewhere() if compiling_elsewhere else contextlib.nullcontext():
            timer.start()
            # Its first forward waits at the gate; its first step waits for the serving
            # forward to end. (The hold is per module: once the serving thread has left
            # the gate, the training forward may overtake it and hold the last Linear
            # first; without the join, its step could then change that Linear's
            # parameters before the serving forward reaches them, as it would in plain
            # PyTorch: the prediction would mix two versions of the model.)
            grads, params = _train(model, batches,
                                   after_first_forward=lambda: serving.join(30))
    finally:
        gate.release.set()
        timer.cancel()
        serving.join(30)
    assert not serving.is_alive()
    assert "error" not in out
    assert torch.equal(out["y"], expected)
    assert gate.log[0] == "serving" and gate.log[1] == "MainThread"  # it did wait
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)


def test_forward_waiting_for_a_holder_blocked_in_a_wait_is_refused_and_changes_nothing():
    # The serving thread is inside the gate, blocked in Event.wait: it may be waiting
    # for the training thread (which sets the event only after its own forward), so
    # waiting could be for ever. The training forward is refused, naming the rule and
    # the way out; the refusal touched nothing, and a retry trains as one thread.
    batches = _batches(3)
    ref_grads, ref_params = _train(_model(), batches)

    model = _model()
    gate = model[2]
    out: dict = {}
    serving = _serving_thread(model, torch.randn(4, 16), out)
    serving.start()
    try:
        assert gate.inside.wait(30)
        with pytest.raises(RuntimeError, match=r"two threads.*'_Gate'.*'serving'.*blocked "
                           r"in threading\.wait.*waiting for this thread.*Retry.*"
                           r"copy\.deepcopy") as refused:
            model(batches[0][0])
        assert "'MainThread'" in str(refused.value)
        # (not O1: beside a training thread, O1's serving threads change its grads)
        assert "O1" not in str(refused.value)
        assert all(p.grad is None for p in model.parameters())
        assert all(type(p) is nn.Parameter and p.dtype is torch.float32
                   for m in model.modules() if m is not gate
                   for p in m._parameters.values())
    finally:
        gate.release.set()
        serving.join(30)
    assert "error" not in out
    grads, params = _train(model, batches)
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)


def test_two_threads_entering_modules_in_opposite_orders_are_refused_not_deadlocked():
    # Thread "a" is inside module A and calls B; thread "b" is inside B and calls A.
    # Each would wait for the other for ever: the second to wait is refused, and the
    # first then proceeds.
    inside = {"a": threading.Event(), "b": threading.Event()}

    class _Calls(nn.Linear):
        def __init__(self, me: str, other: str) -> None:
            super().__init__(8, 8)
            self.me, self.other = me, other
            self.next: list[nn.Module] = []  # (not a child: no cycle among modules)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            if threading.current_thread().name == self.me:
                inside[self.me].set()
                deadline = time.monotonic() + 30
                while not inside[self.other].is_set() and time.monotonic() < deadline:
                    time.sleep(0.001)  # busy, not blocked in a wait
                y = self.next[0](y)
            return y

    torch.manual_seed(0)
    model = ampkit.initialize(nn.Sequential(_Calls("a", "b"), _Calls("b", "a")),
                              level="O2", dtype="bfloat16")
    a, b = model[0], model[1]
    a.next.append(b)
    b.next.append(a)
    x = torch.randn(2, 8)
    results: dict = {}

    def run(name: str, module: nn.Module) -> None:
        try:
            with torch.no_grad():
                results[name] = module(x.to(torch.bfloat16))
        except RuntimeError as e:
            results[name] = e

    threads = [threading.Thread(target=run, args=("a", a), name="a"),
               threading.Thread(target=run, args=("b", b), name="b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    errors = [r for r in results.values() if isinstance(r, RuntimeError)]
    assert len(errors) == 1, results
    assert "wait for each other" in str(errors[0]) and "opposite orders" in str(errors[0])
    done = next(r for r in results.values() if isinstance(r, torch.Tensor))
    assert done.dtype is torch.bfloat16
    # every module has its fp32 parameters back
    assert all(type(p) is nn.Parameter and p.dtype is torch.float32
               for p in [*a._parameters.values(), *b._parameters.values()])


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
    # while the training thread trains. No forward is refused (each waits for the
    # module the other is inside), and the training run is bit for bit the
    # single-thread run.
    batches = _batches(40)
    ref_grads, ref_params = _train(_model(), batches)
    model = _model()
    model[2].release.set()
    stop = threading.Event()
    served, errors = [0], []

    def serve() -> None:
        x = torch.randn(4, 16)
        while not stop.is_set():
            try:
                with torch.no_grad():
                    y = model(x)
                assert y.dtype is torch.float32 and bool(torch.isfinite(y).all())
                served[0] += 1
            except BaseException as e:  # handed to the test thread
                errors.append(e)
                return

    serving = threading.Thread(target=serve, name="serving")
    # (threads switch every 10 us instead of 5 ms: the two forwards overlap in every
    # step, not by chance)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    serving.start()
    try:
        grads, params = _train(model, batches)
    finally:
        stop.set()
        serving.join(30)
        sys.setswitchinterval(interval)
    assert not serving.is_alive()
    assert errors == []
    # Whether the two met in this run is up to the scheduler (on a loaded machine they
    # may not): the meeting itself is made certain by the gated test above; this one
    # checks that a free-running serving thread never changes the training.
    assert served[0] > 0
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)


def test_load_state_dict_from_another_thread_waits_and_lands_in_the_fp32_parameters():
    # The serving thread is inside the gate (its low-precision copies in the gate's
    # _parameters). A refresh, serving.load_state_dict(trained.state_dict()), from the
    # training thread waits for that forward, then loads into the fp32 parameters.
    model = _model()
    gate = model[2]
    gate.spin = True
    new = {k: torch.full_like(v, 0.03125) for k, v in model.state_dict().items()}
    out: dict = {}
    serving = _serving_thread(model, torch.randn(4, 16), out)
    serving.start()
    assert gate.inside.wait(30)
    timer = threading.Timer(0.3, gate.release.set)
    timer.start()
    try:
        model.load_state_dict(new)
    finally:
        gate.release.set()
        timer.cancel()
        serving.join(30)
    assert not serving.is_alive() and "error" not in out
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and p.dtype is torch.float32
        assert torch.equal(p.detach(), new[name]), name
    assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())


def test_every_load_state_dict_from_another_thread_lands_during_forwards():
    # A loader thread refreshes the model (load_state_dict) again and again while the
    # main thread predicts: each load is, right after it returns, what the parameters
    # hold in fp32, and no forward fails.
    torch.manual_seed(0)
    model = ampkit.initialize(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
                              level="O2", dtype="bfloat16")
    keys = list(model.state_dict())
    dicts = [{k: torch.full_like(v, 0.01 * (i + 1)) for k, v in model.state_dict().items()}
             for i in range(7)]
    lost, errors, loads = [], [], [0]
    stop = threading.Event()

    def loader() -> None:
        try:
            while not stop.is_set():
                sd = dicts[loads[0] % 7]
                model.load_state_dict(sd)
                loads[0] += 1
                now = dict(model.named_parameters())
                if not all(now[k].dtype is torch.float32 and torch.equal(now[k], sd[k])
                           for k in keys):
                    lost.append(loads[0])
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    x = torch.randn(8, 16)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread = threading.Thread(target=loader, name="loader")
    thread.start()
    try:
        for _ in range(300):
            with torch.no_grad():
                model(x)
    finally:
        stop.set()
        thread.join(30)
        sys.setswitchinterval(interval)
    assert not thread.is_alive()
    assert errors == [] and lost == [] and loads[0] > 0
    model.load_state_dict(dicts[0])
    assert all(torch.equal(v, dicts[0][k]) for k, v in model.state_dict().items())


@pytest.mark.slow  # (two inductor compilations of a small model: ~50 s on 2 loaded cores)
def test_compiled_model_beside_another_threads_compilation_trains_as_alone():
    # torch.compile(model) runs the model's call (its boundary) as Python and compiles
    # its forward. While another thread compiles (a backend held open here), torch's
    # flag torch.compiler.is_compiling() is set for the whole process: the model's
    # eager call must not take itself for traced. A step then equals the step alone.
    def run(step_during_other_compile: bool):
        torch.manual_seed(0)
        model = ampkit.initialize(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                nn.Linear(32, 4)),
                                  level="O2", dtype="bfloat16")
        # (inductor: the graph the model's forward gets then fuses its casts
        # otherwise than the one it gets alone)
        compiled = torch.compile(model)
        x = torch.randn(8, 16)
        compiled(x).square().mean().backward()  # compiled, warm
        model.zero_grad()
        entered, release = threading.Event(), threading.Event()

        def backend(gm, example_inputs):
            entered.set()
            assert release.wait(30)
            return gm

        other = threading.Thread(target=lambda: torch.compile(
            lambda t: t * 2, backend=backend)(torch.ones(3)), name="compiling")
        if step_during_other_compile:
            other.start()
            assert entered.wait(30)
        try:
            out = compiled(x)
            out.square().mean().backward()
        finally:
            release.set()
            if step_during_other_compile:
                other.join(30)
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out_alone, grads_alone = run(False)
    out, grads = run(True)
    assert torch.equal(out, out_alone)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_alone, strict=True))


class _Checkpointed(nn.Module):
    """A block run under torch.utils.checkpoint: its backward recomputes its forward
    (the block's copies swapped in again) while the serving thread may be inside it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        # (pre: the block's input requires grad, which reentrant checkpointing needs)
        self.pre = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        if torch.is_grad_enabled():
            h = torch.utils.checkpoint.checkpoint(self.block, x,
                                                  use_reentrant=self.reentrant)
        else:
            h = self.block(x)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_training_with_a_serving_thread_trains_as_one_thread(reentrant):
    # The recomputation in backward takes its turn with the serving thread's forwards
    # like any forward: no refusal, and the training equals one thread's bit for bit.
    def model() -> nn.Module:
        torch.manual_seed(0)
        return ampkit.initialize(_Checkpointed(reentrant), level="O2", dtype="bfloat16")

    batches = _batches(20)
    ref_grads, ref_params = _train(model(), batches)
    trained = model()
    stop = threading.Event()
    served, errors = [0], []

    def serve() -> None:
        x = torch.randn(4, 16)
        while not stop.is_set():
            try:
                with torch.no_grad():
                    trained(x)
                served[0] += 1
            except BaseException as e:  # handed to the test thread
                errors.append(e)
                return

    serving = threading.Thread(target=serve, name="serving")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    serving.start()
    try:
        grads, params = _train(trained, batches)
    finally:
        stop.set()
        serving.join(30)
        sys.setswitchinterval(interval)
    assert not serving.is_alive()
    assert errors == [] and served[0] > 0
    _assert_same(grads, ref_grads)
    _assert_same(params, ref_params)


def _bounded(fn, seconds: float = 30.0):
    """``fn()`` on a thread of its own, joined for ``seconds``: a forward that would
    wait for ever fails the test instead of hanging it."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    thread = threading.Thread(target=run, name="bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call did not end (a wait that never ends)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _assert_is_the_model_outside_forwards(copied: nn.Module, model: nn.Module) -> None:
    # No hold mark and only fp32 Parameters in every module's own _parameters (what
    # the module holds, not what named_parameters reports), equal to the original's.
    for (name, module), (_, original) in zip(copied.named_modules(),
                                             model.named_modules(), strict=True):
        assert "_ampkit_held_by" not in module.__dict__, name
        for key, p in module._parameters.items():
            assert type(p) is nn.Parameter and p.dtype is torch.float32, (name, key)
            assert torch.equal(p.detach(), original._parameters[key].detach()), (name, key)
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(_bounded(lambda: copied(x)), expected)  # another thread's call
    x.requires_grad_(True)
    copied(x).sum().backward()  # and this thread's, training
    assert all(p.grad is not None and p.grad.dtype is torch.float32
               for p in copied.parameters())


def _save_and_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_taken_while_another_thread_is_inside_the_forward_is_the_model(how):
    # The serving copy the thread rule recommends, taken while a serving thread is
    # inside the gate (its bf16 copies and its hold mark in the gate): the copy has the
    # fp32 Parameters and no mark, and its forward runs (it does not wait for the
    # serving thread) and computes what the original computes.
    model = _model()
    gate = model[2]
    gate.spin = True
    out: dict = {}
    serving = _serving_thread(model, torch.randn(4, 16), out)
    serving.start()
    try:
        assert gate.inside.wait(30)
        assert type(gate._parameters["weight"]) is not nn.Parameter  # (copies in place)
        copied = copy.deepcopy(model) if how == "deepcopy" else _save_and_load(model)
    finally:
        gate.release.set()
        serving.join(30)
    assert not serving.is_alive() and "error" not in out
    _assert_is_the_model_outside_forwards(copied, model)


def _hold_the_load(gate: _Gate, *args) -> None:
    # (a load_state_dict pre-hook: after ampkit's, which holds the gate; module-level
    # so that the model pickles)
    if threading.current_thread().name == "loader":
        gate.inside.set()
        assert gate.release.wait(30)


def test_copy_taken_while_another_thread_is_inside_load_state_dict_is_the_model():
    # A copy taken while a loader thread is inside the gate's load_state_dict: no
    # mark comes with it; the copy's forward and its own load_state_dict run.
    model = _model()
    gate = model[2]
    new = {k: torch.full_like(v, 0.03125) for k, v in model.state_dict().items()}
    inside, release = gate.inside, gate.release
    gate.register_load_state_dict_pre_hook(_hold_the_load)
    loader = threading.Thread(target=lambda: model.load_state_dict(new), name="loader")
    loader.start()
    try:
        assert inside.wait(30)
        assert "_ampkit_held_by" in gate.__dict__  # (the loader holds the gate)
        copies = [copy.deepcopy(model), _save_and_load(model)]
    finally:
        release.set()
        loader.join(30)
    assert not loader.is_alive()
    for copied in copies:
        assert "_ampkit_held_by" not in copied[2].__dict__
        assert all(type(p) is nn.Parameter and p.dtype is torch.float32
                   for p in copied[2]._parameters.values())
        x = torch.randn(4, 16)
        assert _bounded(lambda c=copied, x=x: c(x)).dtype is torch.float32
        _bounded(lambda c=copied: c.load_state_dict(new))
        assert all(torch.equal(v, new[k]) for k, v in copied.state_dict().items())
        with torch.no_grad():
            assert torch.equal(copied(x), model(x))  # (both now hold `new`)


def test_copy_taken_while_another_thread_trains_inside_the_forward_is_the_model():
    # The training thread inside the gate with grad (its copies have autograd history,
    # which torch's deepcopy of a tensor refuses): a copy from another thread is the
    # model outside forwards.
    model = _model()
    gate = model[2]
    gate.spin = True
    out: dict = {}

    def train() -> None:
        try:
            out["loss"] = model(torch.randn(4, 16)).sum()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    training = threading.Thread(target=train, name="serving")  # (the gate holds it)
    training.start()
    try:
        assert gate.inside.wait(30)
        copied = copy.deepcopy(model)
    finally:
        gate.release.set()
        training.join(30)
    assert not training.is_alive() and "error" not in out
    out["loss"].backward()
    _assert_is_the_model_outside_forwards(copied, model)


def test_a_mark_whose_thread_has_exited_does_not_make_a_forward_wait():
    # A hold mark left by a thread that has since exited (here: carried by a pickle
    # made while a forward held the module) is released, not waited for: the forward
    # puts the fp32 parameters back and runs, as the module outside forwards.
    model = _model()
    gate = model[2]
    truth = dict(gate._parameters)
    marked: dict = {}

    def forward_that_leaves_a_mark() -> None:
        with torch.no_grad():
            # a forward's mark and copies as a pickle of the module caught them
            swapped = []
            ampkit.conversion.parameter_casts.swap_params(gate, swapped, BF16, compiling=False)
            marked["state"] = dict(gate.__dict__)
            marked["params"] = dict(gate._parameters)
            ampkit.conversion.parameter_casts.restore_swapped(gate, swapped)

    thread = threading.Thread(target=forward_that_leaves_a_mark, name="exited")
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    gate.__dict__["_ampkit_held_by"] = marked["state"]["_ampkit_held_by"]
    gate._parameters.update(marked["params"])  # (the bf16 copies)
    x = torch.randn(4, 16)
    y = _bounded(lambda: model(x))
    assert "_ampkit_held_by" not in gate.__dict__
    assert all(gate._parameters[k] is p for k, p in truth.items())
    reference = _model()
    with torch.no_grad():
        assert torch.equal(y, reference(x))


def test_two_load_state_dicts_from_two_threads_take_turns():
    # Two threads loading into one module: the second waits for the first's load
    # (as for a forward), so the module's load pre-hooks never overlap.
    model = _model()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    inside, peak = [0], [0]

    def slow(*args) -> None:
        inside[0] += 1
        peak[0] = max(peak[0], inside[0])
        time.sleep(0.2)
        inside[0] -= 1

    model[0].register_load_state_dict_pre_hook(slow)
    threads = [threading.Thread(target=lambda: model.load_state_dict(sd)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert peak[0] == 1
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
