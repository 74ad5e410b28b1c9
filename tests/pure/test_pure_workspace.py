"""The pure step's scratch (the slices' fp32 working copies and the rounding's noise
buffers) is kept by its optimizer from one step to the next, bounded, never read for
its contents, and never kept from a traced, fake or concurrent step."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
import torch.nn as nn

from ampkit.pure import PureLowPrecisionOptimizer
from ampkit.pure.rounding import BLOCK
from ampkit.pure.step import Workspace, slice_size
from ampkit.torch_internals import fake_tensor_mode, is_fake

LARGE = 5 * BLOCK + 123  # sliced: larger than the smallest slice (4 blocks)


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(LARGE, generator=g).to(torch.bfloat16)),
            nn.Parameter(torch.randn(700, generator=g).to(torch.bfloat16))]


def _optimizer(params: list[nn.Parameter], rounding: str, **options: object
               ) -> PureLowPrecisionOptimizer:
    return PureLowPrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2, **options),
                                     rounding, seed=3)


def _grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)


def _kept(opt: PureLowPrecisionOptimizer) -> dict[object, tuple[int, int]]:
    return {key: (buf.data_ptr(), buf.numel())
            for key, buf in opt._ampkit_pure.workspace.buffers.items()}


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("options", [{}, {"foreach": False}], ids=["fused", "loop"])
def test_the_scratch_is_kept_and_reused_and_what_it_held_changes_nothing(
        rounding: str, options: dict[str, object]) -> None:
    kept, fresh = _params(), _params()
    opt, ref = _optimizer(kept, rounding, **options), _optimizer(fresh, rounding, **options)
    first: dict[object, tuple[int, int]] = {}
    for step in range(3):
        _grads(kept, step)
        _grads(fresh, step)
        opt.step()
        ref._ampkit_pure.workspace = Workspace(shared=True)  # the reference: new each step
        ref.step()
        if step == 1:  # (the first step made the moments: from the second on, all kept)
            first = _kept(opt)
        assert not first or _kept(opt) == first  # the same buffers, none grown or added
        for buf in opt._ampkit_pure.workspace.buffers.values():
            buf.view(torch.uint8).fill_(0xFF)  # NaNs, -1s: garbage for the next step
        for a, b in zip(kept, fresh):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
            sa, sb = opt.state[a], ref.state[b]
            assert sa.keys() == sb.keys()
            for k in sa:
                if isinstance(sa[k], torch.Tensor):
                    assert torch.equal(sa[k], sb[k]), k
    assert any(key[0] == "noise" for key in first)  # the rounding's buffers are kept too
    # weight, gradient and two moments
    assert len([key for key in first if isinstance(key[0], int)]) == 4


def test_the_kept_scratch_is_one_slice_of_copies_whatever_the_budget() -> None:
    assert slice_size(0) == 4 * BLOCK
    assert slice_size(16 * 6 * BLOCK) == 6 * BLOCK
    assert slice_size(1 << 40) == 16 * BLOCK  # not a sixteenth of a huge model
    p = nn.Parameter(torch.zeros(40 * BLOCK, dtype=torch.bfloat16))
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW([p], lr=1e-3), "stochastic",
                                    chunk_bytes=1 << 40)
    for _ in range(2):  # the second step has moments to copy too
        p.grad = torch.ones_like(p)
        opt.step()
    copies = [b for key, b in opt._ampkit_pure.workspace.buffers.items()
              if isinstance(key[0], int)]
    # weight, gradient and two moments of one slice, padded to whole vector lanes
    assert len(copies) == 4
    assert all(16 * BLOCK <= b.numel() < 16 * BLOCK + 64 * torch.get_num_threads()
               for b in copies)
    assert (p.float() < 0).all()  # and the step did step every slice


def test_a_step_that_finds_the_scratch_in_use_or_on_fake_tensors_has_scratch_apart() -> None:
    space = Workspace(shared=True)
    with space.borrowed() as outer, space.borrowed() as inner:  # as from a second thread
        assert outer is space and inner is not space
    with fake_tensor_mode(), space.borrowed() as fake:  # the memory planner's step
        assert fake is not space and fake is space.fake  # kept apart from real scratch
        fake.scratch("noise", 8, torch.int64, torch.device("cpu"))
    with fake_tensor_mode(), space.borrowed() as again_fake:
        assert again_fake is fake  # kept, as a real step's is: the planner counts it
    assert all(not is_fake(b) for b in space.buffers.values())
    with space.borrowed() as again:  # released: the next step has it again
        assert again is space


def test_two_threads_stepping_one_optimizer_each_get_scratch_of_their_own() -> None:
    # torch's optimizers are not made for this; the scratch must still not be shared
    params = _params()
    opt = _optimizer(params, "stochastic")
    _grads(params, 0)
    opt.step()
    space = opt._ampkit_pure.workspace
    held = threading.Event()
    release = threading.Event()
    seen: list[Workspace] = []

    def hold() -> None:
        with space.borrowed() as mine:
            seen.append(mine)
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        before = _kept(opt)
        opt.step()  # finds the scratch in use
        assert _kept(opt) == before and seen == [space]
    finally:
        release.set()
        holder.join(10)


def test_a_copy_or_a_pickle_of_the_optimizer_keeps_no_scratch() -> None:
    params = _params()
    opt = _optimizer(params, "stochastic")
    _grads(params, 0)
    opt.step()
    assert opt._ampkit_pure.workspace.buffers
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other._ampkit_pure.workspace.buffers == {}
        assert other._ampkit_pure.workspace is not opt._ampkit_pure.workspace


def test_a_step_traced_by_torch_compile_keeps_no_traced_tensor() -> None:
    # a whole training step compiled around the eager pure step: the same bits as
    # uncompiled, and whatever the step kept is a plain tensor
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def make() -> tuple[nn.Module, PureLowPrecisionOptimizer]:
        torch.manual_seed(0)
        m = nn.Linear(64, 5 * BLOCK // 64 + 1).to(torch.bfloat16)
        return m, _optimizer(list(m.parameters()), "stochastic")

    def train(m: nn.Module, opt: PureLowPrecisionOptimizer) -> None:
        (m(x).float() ** 2).sum().backward()
        opt.step()
        opt.zero_grad()

    outer, opt = make()
    whole = torch.compile(train)
    plain, ref = make()
    for _ in range(3):  # from the second step on, the moments are state
        whole(outer, opt)
        train(plain, ref)
    for a, b in zip(outer.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert all(type(b) is torch.Tensor for b in opt._ampkit_pure.workspace.buffers.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steps_on_two_cuda_streams_keep_scratch_of_their_own() -> None:
    # a buffer the last step left on one stream may still be in use there: a step on
    # another stream must not write it, and both must step like a fresh scratch would
    g = torch.Generator().manual_seed(0)
    start = torch.randn(LARGE, generator=g).to(torch.bfloat16)
    grads = [torch.randn(LARGE, generator=g).to(torch.bfloat16) for _ in range(4)]

    def run(streams: list[torch.cuda.Stream]) -> tuple[torch.Tensor, set[object]]:
        p = nn.Parameter(start.cuda())
        opt = _optimizer([p], "stochastic")
        for grad, stream in zip(grads, streams):
            with torch.cuda.stream(stream):
                p.grad = grad.cuda()
                opt.step()
        torch.cuda.synchronize()
        return p.detach().cpu(), {key[2] for key in opt._ampkit_pure.workspace.buffers}

    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    two, keys = run([main, side, main, side])
    one, _ = run([main] * 4)
    assert torch.equal(two.view(torch.int16), one.view(torch.int16))
    assert keys == {main.stream_id, side.stream_id}


def _step_first_under_inference_mode(opt: PureLowPrecisionOptimizer,
                                     ref: PureLowPrecisionOptimizer, step: int) -> None:
    if step == 0:
        with torch.inference_mode():
            opt.step()
    else:
        opt.step()
    ref.step()  # the reference: every step outside inference_mode


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_step_under_inference_mode_leaves_scratch_a_later_step_can_use(
        rounding: str) -> None:
    # torch lets in-place updates of ordinary tensors run under inference_mode, so an
    # optimizer step there works; the scratch it makes is then inference tensors,
    # which no later step outside inference_mode may write into
    kept, fresh = _params(), _params()
    opt, ref = _optimizer(kept, rounding), _optimizer(fresh, rounding)
    for step in range(3):
        _grads(kept, step)
        _grads(fresh, step)
        _step_first_under_inference_mode(opt, ref, step)
    for a, b in zip(kept, fresh):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for k, v in ref.state[b].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(opt.state[a][k], v), k


def test_a_stochastic_step_under_inference_mode_leaves_noise_buffers_a_later_one_can_use(
        ) -> None:
    # no parameter is sliced here: only the stochastic rounding's noise buffers are kept
    w = nn.Parameter(torch.linspace(-1, 1, 1000).to(torch.bfloat16))
    v = nn.Parameter(w.detach().clone())
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "stochastic", seed=1)
    ref = PureLowPrecisionOptimizer(torch.optim.SGD([v], lr=1e-3), "stochastic", seed=1)
    for step in range(2):
        w.grad = torch.full_like(w, 0.3)
        v.grad = torch.full_like(v, 0.3)
        _step_first_under_inference_mode(opt, ref, step)
    assert torch.equal(w.view(torch.int16), v.view(torch.int16))
