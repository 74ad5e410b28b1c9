"""The optimizer step inside backward where users combine it with torch's machinery:
each case is trained both ways on the same seed and data, and the parameters (and
optimizer state) compared bit for bit against the ordinary step, or the combination is
refused with a message: reentrant checkpointing, parameter groups added later, frozen
parameters, ``zero_grad(set_to_none=False)``, an exception in the middle of backward,
and torch's global gradient clipping after backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampkit
from ampkit.step_in_backward import (
    accept_partial_step,
    clip_each_gradient,
    enable_step_in_backward,
    partial_step,
)

BF16 = torch.bfloat16
MODES = [{"master_weights": "stochastic", "rounding_seed": 5},
         {"master_weights": "kahan", "rounding_seed": 5},
         {}]  # O2 with fp32 master weights
IDS = ["stochastic", "kahan", "O2-fp32-masters"]
STEPS = 6


class Net(torch.nn.Module):
    """Three layers; ``branch`` is used only where ``use_branch`` says so."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.branch = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        h = torch.relu(self.mid(h))
        if self.use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(STEPS)]


def _setup(mode: dict, in_backward: bool, params: Callable[[Net], object] | None = None,
           freeze: bool = False) -> tuple[Net, torch.optim.Optimizer]:
    net = Net()
    net.first.weight.requires_grad_(not freeze)
    opt = torch.optim.AdamW(net.parameters() if params is None else params(net),  # type: ignore[arg-type]
                            lr=1e-2, weight_decay=0.1)
    out = ampkit.initialize(net, opt, level="O2", dtype=BF16, step_in_backward=in_backward,
                            **mode)
    return out  # type: ignore[no-any-return]


def _weights(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def _both(mode: dict, loop: Callable[[Net, torch.optim.Optimizer, bool], None],
          params: Callable[[Net], object] | None = None, freeze: bool = False) -> None:
    """Run ``loop`` the ordinary way and stepping in backward; the same weights."""
    net, opt = _setup(mode, False, params, freeze)
    loop(net, opt, False)
    want = _weights(net)
    net, opt = _setup(mode, True, params, freeze)
    loop(net, opt, True)
    assert _same(_weights(net), want)
    assert any(not torch.equal(a, b) for a, b in zip(want, _weights(Net())))  # it trained


# -- reentrant checkpointing -----------------------------------------------------------

def _checkpointed(reentrant: bool, outside: bool = True,
                  ) -> Callable[[Net, torch.optim.Optimizer, bool], None]:
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for x, y in _batches():
            x = x.to(BF16).requires_grad_()  # (the reentrant form needs an input with grad)
            h = checkpoint(lambda a: torch.relu(net.mid(torch.relu(net.first(a)))), x,
                           use_reentrant=reentrant)
            if outside:  # mid is used inside the checkpointed block and again outside
                h = net.mid(h)
            _loss(net.head(h), y).backward()
            if not in_backward:
                opt.step()
                opt.zero_grad()
    return loop


@pytest.mark.parametrize("mode", MODES[:1] + MODES[2:], ids=[IDS[0], IDS[2]])
def test_non_reentrant_checkpointing_with_a_weight_inside_and_outside_steps_once(mode):
    _both(mode, _checkpointed(False))


@pytest.mark.parametrize("mode", MODES[:1] + MODES[2:], ids=[IDS[0], IDS[2]])
def test_reentrant_checkpointing_with_weights_inside_only_steps_like_the_ordinary_step(
        mode):
    _both(mode, _checkpointed(True, outside=False))


def test_reentrant_checkpointing_with_a_weight_inside_and_outside_is_refused():
    # before: the weight used inside and outside the block stepped twice per backward
    net, opt = _setup(MODES[0], True)
    with pytest.raises(RuntimeError, match=r"shape \(16,( 16)?\) received a second gradient "
                       r"in one backward.*use_reentrant=True.*use_reentrant=False"):
        _checkpointed(True)(net, opt, True)
    # what stepped before the refusal is told, and the next use says so again
    assert partial_step(opt) is not None
    with pytest.raises(RuntimeError, match=r"stopped with an exception after \d+ of"):
        net(torch.randn(2, 8))


# -- parameter groups added after initialize ----------------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_a_group_added_after_initialize_steps_like_the_ordinary_step(mode):
    # progressive unfreezing: head and branch train from the start, the rest from step 3
    def params(net: Net) -> object:
        return [*net.head.parameters(), *net.branch.parameters()]

    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for i, (x, y) in enumerate(_batches()):
            if i == 3:
                opt.add_param_group({"params": [*net.first.parameters(),
                                                *net.mid.parameters()], "lr": 5e-3})
            _loss(net(x), y).backward()
            if not in_backward:
                opt.step()
            opt.zero_grad()
    _both(mode, loop, params)


# -- frozen parameters in the optimizer ------------------------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_frozen_parameters_are_skipped_then_step_once_unfrozen(mode):
    # before: initialize raised torch's "cannot register a hook on a tensor that
    # doesn't require gradient"
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for i, (x, y) in enumerate(_batches()):
            if i == 3:
                net.first.weight.requires_grad_(True)
            _loss(net(x), y).backward()
            if not in_backward:
                opt.step()
            opt.zero_grad()
    _both(mode, loop, freeze=True)  # frozen when the optimizer and initialize see it


# -- zero_grad(set_to_none=False) ---------------------------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_zero_grad_keeping_zeros_steps_an_unused_branch_like_the_ordinary_step(mode):
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for i, (x, y) in enumerate(_batches()):
            net.use_branch = i < 2  # unused from step 2: zero gradients, still stepped
            _loss(net(x), y).backward()
            if not in_backward:
                opt.step()
            opt.zero_grad(set_to_none=False)
    _both(mode, loop)


# -- an exception in the middle of backward ------------------------------------------------

def _failing_backward(net: Net, x: torch.Tensor, y: torch.Tensor) -> None:
    h = torch.relu(net.mid(torch.relu(net.first(x.to(BF16)))))

    def detect(grad: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("NaN in the gradient")  # a user's NaN check

    h.register_hook(detect)  # fires after head and branch stepped, before mid and first
    _loss(net.head(h + net.branch(h)), y).backward()


def test_an_exception_mid_backward_is_told_at_the_next_use_with_the_count():
    net, opt = _setup(MODES[0], True)
    x, y = _batches()[0]
    with pytest.raises(FloatingPointError):
        _failing_backward(net, x, y)
    assert partial_step(opt) == (4, 8)  # head's and branch's weight and bias
    for use in (lambda: net(x), lambda: _loss(net(x), y).backward(), opt.state_dict):
        with pytest.raises(RuntimeError, match=r"after 4 of the optimizer's 8 parameters"
                           r".*accept_partial_step"):
            use()
    accept_partial_step(opt)
    assert partial_step(opt) is None
    _loss(net(x), y).backward()  # trains again
    assert all(p.grad is None for p in net.parameters())


def test_reloading_a_checkpoint_after_an_exception_restores_the_ordinary_trajectory():
    mode = MODES[0]
    batches = _batches()
    net, opt = _setup(mode, False)
    for x, y in batches[:3]:
        _loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = _weights(net)

    net, opt = _setup(mode, True)
    _loss(net(batches[0][0]), batches[0][1]).backward()
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    with pytest.raises(FloatingPointError):
        _failing_backward(net, *batches[1])
    net.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for x, y in batches[1:3]:
        _loss(net(x), y).backward()
    assert _same(_weights(net), want)


# -- global gradient clipping after backward ------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
    lambda ps: torch.nn.utils.clip_grad_value_(ps, 1.0),
], ids=["clip_grad_norm_", "clip_grad_value_"])
def test_global_clipping_after_backward_is_refused_not_a_silent_zero(call):
    net, _ = _setup(MODES[0], True)
    x, y = _batches()[0]
    _loss(net(x), y).backward()
    with pytest.raises(RuntimeError, match=r"step inside backward.*clip_each_gradient"):
        call(net.parameters())
    other = torch.nn.Parameter(torch.ones(3))  # any other parameter: torch's own function
    other.grad = torch.full((3,), 4.0)
    call([other])
    assert other.grad.abs().max().item() == 1.0 or other.grad.norm().item() == pytest.approx(1.0)


def test_per_parameter_clipping_still_works_after_the_guard():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = enable_step_in_backward(torch.optim.SGD([w], lr=1.0))
    clip_each_gradient(opt, max_norm=1.0)
    (w * 10).sum().backward()
    assert w.norm().item() == pytest.approx(1.0)


# -- a gradient no hook stepped ------------------------------------------------------------

def test_a_gradient_no_hook_stepped_is_refused_at_the_next_forward():
    # what a torch release (or wrapper) that never calls a parameter's post-accumulate-
    # grad hooks would leave: a gradient the ordinary step would step, never stepped
    net, _ = _setup(MODES[0], True)
    x, y = _batches()[0]
    _loss(net(x), y).backward()
    net.head.weight.grad = torch.ones_like(net.head.weight)  # no hook runs for this
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) .* hold a gradient that "
                       r"was never stepped.*torch 2\."):
        net(x)


# -- a parameter group given as a generator -------------------------------------------------

def test_a_group_added_from_a_generator_keeps_every_parameter():
    # before: the check read the generator and torch added an empty group
    for in_backward in (False, True):
        net, opt = _setup(MODES[0], in_backward, lambda n: n.head.parameters())
        opt.add_param_group({"params": net.mid.parameters()})
        assert [p.shape for p in opt.param_groups[1]["params"]] == [(16, 16), (16,)]


# -- another thread using the model during backward -----------------------------------------

def test_a_forward_in_another_thread_during_backward_changes_nothing():
    # before: the other thread's forward took the pass under way for one stopped by an
    # exception, so training and the other thread both raised
    import threading

    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                with torch.no_grad():
                    net(torch.randn(2, 8).to(BF16))
                net(torch.randn(2, 8).to(BF16))  # with grad: no backward of its own
            except BaseException as e:  # collected and checked below
                errors.append(e)

        def mid_backward(grad: torch.Tensor) -> None:
            t = threading.Thread(target=serve)  # runs while the head has stepped
            t.start()
            t.join()

        for x, y in _batches()[:3]:
            h = torch.relu(net.mid(torch.relu(net.first(x.to(BF16)))))
            h.register_hook(mid_backward)
            _loss(net.head(h + net.branch(h)), y).backward()
            if not in_backward:
                opt.step()
                opt.zero_grad()
        assert errors == []
    _both(MODES[0], loop)


# -- the whole model inside one reentrant checkpoint --------------------------------------------

@pytest.mark.parametrize("keep_zeros", [False, True], ids=["to-none", "keep-zeros"])
def test_the_whole_model_in_one_reentrant_checkpoint_steps_like_the_ordinary_step(keep_zeros):
    # before: refused at the second step (no hook outside the reentrant backward, so the
    # first pass was never ended)
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for i, (x, y) in enumerate(_batches()[:4]):
            net.use_branch = i < 2
            out = checkpoint(net, x.to(BF16).requires_grad_(), use_reentrant=True)
            _loss(out, y).backward()
            if not in_backward:
                opt.step()
            opt.zero_grad(set_to_none=not keep_zeros)
    _both(MODES[0], loop)


# -- pickling a model that steps in backward ---------------------------------------------------

def test_a_model_stepping_in_backward_pickles_and_its_copy_runs():
    # before: "Can't pickle local object 'watch_models.<locals>.before_forward'"
    import io

    net, _ = _setup(MODES[0], True)
    x, y = _batches()[0]
    _loss(net(x), y).backward()
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    copy_ = torch.load(buffer, weights_only=False)
    assert _same(_weights(copy_), _weights(net))
    _loss(copy_(x), y).backward()  # the copy's parameters are its own: plain gradients
    assert copy_.head.weight.grad is not None
    before = _weights(net)
    _loss(net(x), y).backward()  # the original still steps in backward
    assert net.head.weight.grad is None and not _same(_weights(net), before)


# -- a second backward over the same forward -------------------------------------------------

def test_a_second_backward_through_the_same_output_is_refused_in_words():
    # before: torch's "modified by an inplace operation" from the second backward
    net, opt = _setup(MODES[0], True)
    x, y = _batches()[0]
    loss = _loss(net(x), y)
    loss.backward(retain_graph=True)
    stepped = _weights(net)
    with pytest.raises(RuntimeError, match=r"second backward pass over the same forward"
                       r".*Sum the losses.*step_in_backward=False"):
        loss.backward()
    assert _same(_weights(net), stepped) and partial_step(opt) is None


class TwoTasks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 8)  # its backward saves indices, not weights
        self.h1 = torch.nn.Linear(8, 3)
        self.h2 = torch.nn.Linear(8, 3)

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.emb(t)
        return self.h1(e), self.h2(e)


def test_two_losses_backwarded_one_after_the_other_through_a_shared_weight_are_refused():
    # before: the shared embedding stepped twice per forward, silently
    net = TwoTasks()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = ampkit.initialize(net, opt, level="O2", dtype=BF16, step_in_backward=True,
                                 master_weights="stochastic", rounding_seed=5)
    t, y = torch.randint(0, 10, (6,)), torch.randint(0, 3, (6,))
    a, b = net(t)
    _loss(a, y).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"shape \(10, 8\) received a gradient in a second "
                       r"backward pass"):
        _loss(b, y).backward()


def test_two_losses_on_separate_parameters_backwarded_one_after_the_other_are_equal():
    # no parameter gets two gradients: nothing to refuse
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for x, y in _batches()[:3]:
            h = torch.relu(net.mid(torch.relu(net.first(x.to(BF16)))))
            _loss(net.head(h), y).backward(retain_graph=True)
            _loss(net.branch(h.detach()), y % 4).backward()
            if not in_backward:
                opt.step()
                opt.zero_grad()
    _both(MODES[0], loop)


# -- kept zero gradients on frozen parameters, and the model's own zero_grad ----------------

def test_a_parameter_frozen_while_zero_gradients_are_kept_steps_like_the_ordinary_step():
    # before: torch steps a frozen parameter holding a kept zero gradient (weight decay,
    # moments); in backward it was skipped
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for i, (x, y) in enumerate(_batches()[:4]):
            if i == 2:
                net.mid.weight.requires_grad_(False)
            _loss(net(x), y).backward()
            if not in_backward:
                opt.step()
            opt.zero_grad(set_to_none=False)
    _both(MODES[0], loop)


def test_the_models_zero_grad_keeping_zeros_steps_an_unused_branch_like_the_ordinary_step():
    # before: only the optimizer's zero_grad was seen, so the unused branch never stepped
    def loop(net: Net, opt: torch.optim.Optimizer, in_backward: bool) -> None:
        for i, (x, y) in enumerate(_batches()[:4]):
            net.use_branch = i < 2
            _loss(net(x), y).backward()
            if not in_backward:
                opt.step()
            net.zero_grad(set_to_none=False)
    _both(MODES[0], loop)


# -- torch's clipping reached by other paths --------------------------------------------------

def test_clipping_reached_by_every_public_path_is_refused_not_a_silent_zero():
    # before: torch.nn.utils.clip_grad's names, a clip_grad_norm_ bound before initialize
    # and get_total_norm of the (freed) gradients read 0 or failed in torch's words
    import inspect

    from torch.nn.utils import clip_grad

    # torch's function itself, as an import before initialize binds it (the guard is
    # installed once per process, maybe by an earlier test)
    bound_early = inspect.unwrap(clip_grad.clip_grad_norm_)

    net, _ = _setup(MODES[0], True)
    x, y = _batches()[0]
    _loss(net(x), y).backward()
    calls = [lambda: bound_early(net.parameters(), 1.0),
             lambda: clip_grad.clip_grad_norm_(net.parameters(), 1.0),
             lambda: clip_grad.clip_grad_value_(net.parameters(), 1.0),
             lambda: torch.nn.utils.get_total_norm(
                 [p.grad for p in net.parameters() if p.grad is not None])]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"step.* inside backward.*clip_each_gradient"):
            call()
    other = torch.nn.Parameter(torch.ones(3))  # any other parameter: torch's own result
    other.grad = torch.full((3,), 4.0)
    assert bound_early([other], 1.0).item() == pytest.approx(48 ** 0.5)
    assert other.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
