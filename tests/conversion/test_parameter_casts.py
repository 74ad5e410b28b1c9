"""At O2 the fp32 parameters are the truth: everything PyTorch does to a parameter or a
gradient just works, because ampkit keeps no copy that could fall out of step.

Oracles: the value a user's edit asks for (a clamped gradient moves a weight by at most
the clamp), the same training run without ampkit's copies (a hand-written step on
``param.to(bf16)`` copies), and plain PyTorch behaviour (save/load, deepcopy, LBFGS)."""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import on_forward
from torch.utils.checkpoint import checkpoint

import ampkit
from ampkit.conversion.parameter_casts import is_cached

BF16, FP32 = torch.bfloat16, torch.float32


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def _o2(seed=0, opt_cls=torch.optim.SGD, **opt_kw):
    model = _model(seed)
    opt = opt_cls(model.parameters(), **(opt_kw or {"lr": 0.5}))
    return ampkit.initialize(model, opt, level="O2", dtype=BF16)


def _loss(model, seed=1):
    x, y = _batch(seed)
    return F.cross_entropy(model(x), y)


def test_parameters_and_gradients_are_plain_fp32():
    model, opt = _o2()
    assert type(opt) is torch.optim.SGD
    _loss(model).backward()
    assert all(p.dtype is FP32 and type(p) is nn.Parameter for p in model.parameters())
    assert all(p.grad.dtype is FP32 for p in model.parameters())


def test_gradient_edits_through_data_are_applied():
    model, opt = _o2(opt_cls=torch.optim.SGD, lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model).backward()
    for p in model.parameters():
        p.grad.data.clamp_(-0.01, 0.01)
    opt.step()
    moved = max((p - b).abs().max().item() for p, b in zip(model.parameters(), before))
    assert 0 < moved <= 0.01 + 1e-7


def test_gradient_replaced_through_data_is_applied():
    model, opt = _o2(opt_cls=torch.optim.SGD, lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model).backward()
    for p in model.parameters():
        p.grad.data = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_weight_edit_after_the_step_is_seen_by_the_next_forward():
    model, opt = _o2()
    _loss(model).backward()
    opt.step()
    for p in model.parameters():
        p.data.clamp_(-0.01, 0.01)  # WGAN-style clipping through .data
    seen = []
    on_forward(model[0], lambda m, a: seen.append(m.weight.float()))
    model(torch.randn(2, 8))
    assert seen[0].abs().max().item() <= torch.tensor(0.01).to(BF16).item()


def test_training_equals_a_hand_written_step_on_bf16_copies():
    # What O2 promises: forward on bf16(weights), the norm in fp32, fp32 updates.
    model, opt = _o2(opt_cls=torch.optim.AdamW, lr=1e-2)
    ref = _model(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        w1, b1, g, b, w2, b2 = ref.parameters()
        with torch.autocast("cpu", BF16):
            h = F.linear(x.to(BF16), w1.to(BF16), b1.to(BF16))
        h = F.layer_norm(h.float(), (16,), g, b).to(BF16)
        with torch.autocast("cpu", BF16):
            out = F.linear(F.relu(h), w2.to(BF16), b2.to(BF16))
        F.cross_entropy(out.float(), y).backward()
        ref_opt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, r), step


def test_gradients_accumulate_in_fp32_exactly():
    model, _ = _o2()
    micro = [_batch(s) for s in range(8)]
    for x, y in micro:
        F.cross_entropy(model(x), y).backward()
    # The same sum, accumulated by hand in fp32 from single-batch gradients.
    total = [torch.zeros_like(p) for p in model.parameters()]
    for x, y in micro:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for t, p in zip(total, model.parameters()):
            t += p.grad
    again, _ = _o2()
    for x, y in micro:
        F.cross_entropy(again(x), y).backward()
    for t, p in zip(total, again.parameters()):
        assert torch.equal(p.grad, t)


def test_a_copy_lives_for_one_forward_and_is_shared_within_it():
    # The contract: copies are not kept across the micro-batches of one optimizer step
    # (that missed .data edits); each forward casts afresh, and a weight used twice in
    # one forward is cast once.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    model = ampkit.initialize(nn.Sequential(lin, nn.ReLU(), lin), level="O2", dtype=BF16)
    on_forward(model[0], lambda m, a: casts.append(m._parameters["weight"]))
    casts, held = [], []
    model[1].register_forward_hook(lambda m, a, o: held.append(is_cached(lin.weight)))
    model(torch.randn(2, 8)).sum().backward()
    assert casts[0] is casts[1]  # one bf16 copy for both uses in one forward
    assert held == [True] and not is_cached(lin.weight)  # dropped when the forward ends
    model(torch.randn(2, 8)).sum().backward()
    assert casts[2] is not casts[1]
    assert torch.equal(casts[2], lin.weight.detach().to(BF16))


def test_in_place_change_between_micro_batches_makes_a_new_copy():
    model, opt = _o2()
    _loss(model).backward()
    opt.step()
    casts = []
    on_forward(model[0], lambda m, a: casts.append(m._parameters["weight"]))
    _loss(model, 2).backward()
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    _loss(model, 3).backward()
    assert torch.equal(casts[1], model[0].weight.detach().to(BF16))


def test_no_grad_forward_does_not_take_the_gradient_away():
    model, _ = _o2()
    with torch.no_grad():
        model(torch.randn(2, 8))
    _loss(model).backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.inference_mode():
        model(torch.randn(2, 8))
    model.zero_grad()
    _loss(model).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_torch_save_and_load_of_model_and_optimizer():
    model, opt = _o2(opt_cls=torch.optim.AdamW, lr=1e-2)
    _loss(model).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model, "opt": opt}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for a, b in zip(model.parameters(), loaded["model"].parameters()):
        assert a.dtype is FP32 and torch.equal(a, b)
    out = loaded["model"](torch.randn(2, 8))
    assert out.dtype is FP32
    assert loaded["opt"].state_dict()["state"][0]["exp_avg"].dtype is FP32


def test_deepcopy_trains_on_its_own():
    model, _ = _o2()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    _loss(twin).backward()
    twin_opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not torch.equal(twin[0].weight, model[0].weight)


def test_optimizer_made_after_initialize_and_add_param_group():
    model = ampkit.initialize(_model(), level="O2", dtype=BF16)
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    opt.add_param_group({"params": list(model[3].parameters()), "lr": 1e-3})
    _loss(model).backward()
    opt.step()
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {FP32}


def test_clip_grad_norm_and_value_through_model_parameters():
    model, _ = _o2(opt_cls=torch.optim.SGD, lr=1.0)
    _loss(model).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    total = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert total.item() == pytest.approx(1e-3, rel=1e-4)
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-5)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 1e-5


def test_lbfgs_closure_sees_the_weights_it_tries():
    model, opt = _o2(opt_cls=torch.optim.LBFGS, lr=0.5, max_iter=5)
    x, y = _batch()
    first = F.cross_entropy(model(x), y).item()
    for _ in range(3):
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    assert F.cross_entropy(model(x), y).item() < 0.8 * first


def test_scheduler_and_averaged_model():
    model, opt = _o2()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = torch.optim.swa_utils.AveragedModel(model)
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        sched.step()
        ema.update_parameters(model)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)
    assert ema(torch.randn(2, 8)).dtype is FP32
    assert all(p.dtype is FP32 for p in ema.parameters())


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_strict_and_assign(assign):
    model, _ = _o2()
    source = _model(7)
    result = model.load_state_dict(source.state_dict(), assign=assign)
    assert not result.missing_keys and not result.unexpected_keys
    for p, s in zip(model.parameters(), source.parameters()):
        assert torch.equal(p, s)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # over the assigned parameters
    before = model[0].weight.detach().clone()
    _loss(model).backward()
    opt.step()
    assert not torch.equal(model[0].weight, before)
    partial = {k: v for k, v in source.state_dict().items() if not k.startswith("3.")}
    assert model.load_state_dict(partial, strict=False).missing_keys == ["3.weight", "3.bias"]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(use_reentrant):
    model, _ = _o2()
    plain, _ = _o2()
    x, y = _batch()
    F.cross_entropy(plain(x), y).backward()

    inner = model[0]
    # Checkpoint the first Linear: its recomputation in backward runs its hooks again.
    model[0] = _Checkpointed(inner, use_reentrant)
    F.cross_entropy(model(x.requires_grad_(use_reentrant)), y).backward()
    for p, q in zip(inner.parameters(), plain[0].parameters()):
        assert torch.equal(p.grad, q.grad)


class _Checkpointed(nn.Module):
    def __init__(self, inner, use_reentrant):
        super().__init__()
        self.inner = inner
        self.use_reentrant = use_reentrant

    def forward(self, t):
        return checkpoint(self.inner, t, use_reentrant=self.use_reentrant)


def test_torch_amp_grad_scaler_works_at_o2_fp16():
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    losses = []
    for step in range(20):
        opt.zero_grad()
        loss = _loss(model, step % 2)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.grad.dtype is FP32 for p in model.parameters())


def test_a_discarded_model_leaves_no_cached_copy_behind() -> None:
    """A copy that requires grad holds its parameter (through its autograd node): kept
    in the cache past the forward pass of a model no optimizer steps, it would keep the
    model's parameters alive for good. No copy outlives the forward."""
    import gc
    import weakref

    from ampkit.conversion.parameter_casts import cached_casts, forget_casts

    forget_casts()
    model = ampkit.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                  torch.nn.Linear(4, 2)),
                              level="O2", dtype=torch.bfloat16)
    gone = weakref.ref(model[0].weight)
    model(torch.rand(3, 4, device="cpu")).sum().backward()
    assert cached_casts() == 0  # nothing outlives the forward
    del model
    gc.collect()
    assert gone() is None
