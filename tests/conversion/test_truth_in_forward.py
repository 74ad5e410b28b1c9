"""The truth during the forward: at O2 a converted module's forward computes
with low-precision copies of its fp32 parameters; whatever else touches a parameter
during the forward must touch the fp32 truth, as in fp32 training, or be refused.

Oracles: fp32 training and native ``torch.autocast`` on the same model and batch (an
in-place edit made in the forward, a constraint hook, a regulariser over
``self.parameters()``), bit for bit where both compute the same fp32 ops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class _Lookup(nn.Module):
    """An embedding (or bag) with ``max_norm``, then a head: rows of norm ~4 at init."""

    def __init__(self, bag: bool, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        kind = nn.EmbeddingBag if bag else nn.Embedding
        self.emb = kind(40, 16, max_norm=1.0)
        self.head = nn.Linear(16, 40, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.bag = bag

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) if self.bag else self.emb(ids).mean(1)
        return self.head(h)


def _ids(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (8, 5), generator=g), torch.randint(0, 40, (8,), generator=g)


def _train(model: nn.Module, steps: int, ctx=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    ids, y = _ids(0)  # one batch, learnt: the loss moves far in 20 steps
    for _ in range(steps):
        if ctx is None:
            loss = F.cross_entropy(model(ids), y)
        else:
            with ctx():
                loss = F.cross_entropy(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_max_norm_renormalises_the_fp32_weight(bag: bool, tied: bool) -> None:
    fp32, native = _Lookup(bag, tied), _Lookup(bag, tied)
    o2 = ampkit.initialize(_Lookup(bag, tied), level="O2", dtype=BF16)
    ids, _ = _ids(0)
    fp32(ids)
    with torch.autocast("cpu", BF16):
        native(ids)
    o2(ids)
    # fp32 training renormalises the looked-up rows of its fp32 weight in the forward;
    # so does native autocast (the lookup is not cast); O2 must do it to its truth
    assert o2.emb.weight.dtype is FP32
    assert torch.equal(native.emb.weight, fp32.emb.weight)
    assert torch.equal(o2.emb.weight, fp32.emb.weight)
    used = o2.emb.weight[ids.unique()].norm(dim=1)
    assert used.max().item() <= 1.0 + 1e-6


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_max_norm_training_follows_fp32(bag: bool) -> None:
    fp32 = _train(_Lookup(bag), 20)
    native = _train(_Lookup(bag), 20, lambda: torch.autocast("cpu", BF16))
    o2 = _train(ampkit.initialize(_Lookup(bag), level="O2", dtype=BF16), 20)
    assert abs(native[-1] - fp32[-1]) < 5e-3
    assert abs(o2[-1] - fp32[-1]) < 5e-3, (o2[-1], fp32[-1], native[-1])


def _clamp(module: nn.Module, args: object) -> None:
    module.seen.append(module.weight.dtype)
    module.weight.data.clamp_(-0.05, 0.05)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("when", ["before", "after", "after_prepend"])
def test_constraint_pre_hook_edits_the_truth(when: str) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    fp32, o2 = _mlp(), _mlp()
    for m in (fp32, o2):
        m[0].seen = []
    fp32[0].register_forward_pre_hook(_clamp)
    if when == "before":
        o2[0].register_forward_pre_hook(_clamp)
    o2 = ampkit.initialize(o2, level="O2", dtype=BF16)
    if when != "before":
        o2[0].register_forward_pre_hook(_clamp, prepend=when == "after_prepend")
    out32, out = fp32(x), o2(x)
    # the hook sees the fp32 parameter, and its clamp is made to the truth
    assert o2[0].seen == [FP32]
    assert o2[0].weight.abs().max().item() <= torch.tensor(0.05).item()
    assert torch.equal(o2[0].weight, fp32[0].weight)
    # and the forward computes with the clamped weight
    torch.testing.assert_close(out, out32, rtol=2e-2, atol=2e-2)


class _EditsInForward(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(self.factor)
        return self.lin(x) * self.scale


class _ChildEdits(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.05, 0.05)
        return super().forward(x)


def test_in_place_edit_of_a_copy_in_forward_is_refused() -> None:
    x = torch.randn(2, 8)
    model = ampkit.initialize(_EditsInForward(0.5), level="O2", dtype=BF16)
    with pytest.raises(RuntimeError, match=r"'_EditsInForward' edited its parameter "
                                           r"'scale' in place"):
        model(x)
    # everything is put back: the truth is untouched and the next forward runs
    assert type(model.scale) is nn.Parameter and torch.equal(model.scale.detach(),
                                                             torch.ones(8))
    model.factor = 1.0  # an in-place op that changes no value is no edit
    assert model(x).dtype is FP32


def test_in_place_edit_of_a_childs_copy_is_refused() -> None:
    torch.manual_seed(0)
    model = ampkit.initialize(nn.Sequential(_ChildEdits(8, 8), nn.ReLU()), level="O2",
                              dtype=BF16)
    with pytest.raises(RuntimeError, match=r"module '0' '_ChildEdits' edited its "
                                           r"parameter 'weight'"):
        model(torch.randn(2, 8))
    assert model[0].weight.dtype is FP32 and model[0].weight.abs().max() > 0.05
    # in fp32 the same module edits its weight, which is what O2 could not do silently
    fp32 = _ChildEdits(8, 8)
    fp32(torch.randn(2, 8))
    assert fp32.weight.abs().max().item() <= torch.tensor(0.05).item()


class _Regularised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.randn(16))
        self.lin = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = list(self.parameters())
        self.penalty = sum(p.pow(2).sum() for p in self.parameters())
        return self.head(self.lin(x) * self.scale)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_regulariser_in_forward_sees_the_fp32_parameters(dtype: torch.dtype) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    fp32, native = _Regularised(), _Regularised()
    o2 = ampkit.initialize(_Regularised(), level="O2", dtype=dtype)
    fp32(x)
    with torch.autocast("cpu", dtype):
        native(x)
    o2(x)
    assert [p is q for p, q in zip(o2.seen, o2.parameters())] == [True] * 5
    assert o2.penalty.dtype is FP32
    assert o2.penalty.item() == fp32.penalty.item() == native.penalty.item()
    o2.penalty.backward()  # its gradient reaches the fp32 .grad directly
    fp32.penalty.backward()
    for p, q in zip(o2.parameters(), fp32.parameters()):
        assert torch.equal(p.grad, q.grad)


def _classifier_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_o1_loss_outside_the_model_equals_native_loss_inside(dtype: torch.dtype) -> None:
    x, y = _classifier_batch()
    native, o1 = _mlp(), ampkit.initialize(_mlp(), level="O1", dtype=dtype)
    with torch.autocast("cpu", dtype):
        ref = F.cross_entropy(native(x), y)  # the loss inside native's region
    out = o1(x)
    loss = F.cross_entropy(out, y)  # the user's loop: outside the model
    assert out.dtype is FP32 and loss.dtype is FP32 and ref.dtype is FP32
    assert loss.item() == ref.item()
    loss.backward()
    ref.backward()
    for p, q in zip(o1.parameters(), native.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_o1_loss_inside_the_model_stays_bit_equal_to_native() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.net(x), y)

    x, y = _classifier_batch()
    native, o1 = WithLoss(), ampkit.initialize(WithLoss(), level="O1", dtype=BF16)
    with torch.autocast("cpu", BF16):
        ref = native(x, y)
    got = o1(x, y)
    assert got.dtype is ref.dtype is FP32 and got.item() == ref.item()


def test_apex_o1_loss_outside_the_model_is_fp32() -> None:
    from ampkit import apex as amp

    x, y = _classifier_batch()
    native = _mlp()
    model = _mlp()
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              opt_level="O1")
    out = model(x)
    loss = F.cross_entropy(out, y)  # apex patches cross_entropy to fp32 (FP32_FUNCS)
    with torch.autocast("cpu", FP16):
        ref = F.cross_entropy(native(x), y)
    assert out.dtype is FP32 and loss.dtype is FP32
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    assert loss.item() == F.cross_entropy(out.half().float(), y).item()


@pytest.mark.parametrize("amp_level", ["O1", "O2", "O3"])
def test_mindspore_hands_results_back_in_fp32(amp_level: str) -> None:
    from ampkit import mindspore

    x, y = _classifier_batch()
    model = mindspore.auto_mixed_precision(_mlp(), amp_level=amp_level)
    out = model(x)
    assert out.dtype is FP32 and F.cross_entropy(out, y).dtype is FP32


def test_the_cast_stays_after_pre_hooks_across_deepcopy() -> None:
    o2 = ampkit.initialize(_mlp(), level="O2", dtype=BF16)
    o2[0].seen = []
    o2[0].register_forward_pre_hook(_clamp)
    twin = copy.deepcopy(o2)
    twin[0].register_forward_pre_hook(lambda m, a: m.seen.append(m.weight.dtype),
                                      prepend=True)
    twin(torch.randn(2, 8))
    assert twin[0].seen == [FP32, FP32]


# -- every way of reading a parameter inside the forward agrees -------------------------


class _Reads(nn.Linear):
    """Reads its parameters every way torch offers, inside its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.read = {
            "state_dict": self.state_dict(),
            "state_dict_vars": self.state_dict(keep_vars=True),
            "get_parameter": {n: self.get_parameter(n) for n in ("weight", "bias")},
            "named_parameters": dict(self.named_parameters()),
            "parameters": list(self.parameters()),
        }
        return super().forward(x)


@pytest.mark.parametrize("hooked", [False, True], ids=["fast-call", "with-hook"])
def test_every_read_of_a_parameter_inside_an_o2_forward_gives_the_truth(hooked):
    torch.manual_seed(0)
    net = ampkit.initialize(_Reads(4, 3), level="O2", dtype="bfloat16")
    if hooked:  # the hooks' route (another forward hook on the module), not the fast call
        net.register_forward_hook(lambda *args: None)
    truth = {"weight": net.weight, "bias": net.bias}
    y = net(torch.randn(2, 4))
    assert y.dtype is FP32
    read = net.read
    for name, param in truth.items():
        value = read["state_dict"][name]
        assert value.dtype is FP32 and torch.equal(value, param.detach())
        assert not value.requires_grad
        assert read["state_dict_vars"][name] is param
        assert read["get_parameter"][name] is param
        assert read["named_parameters"][name] is param
    assert all(a is b for a, b in zip(read["parameters"], truth.values(), strict=True))
    # (outside the forward, as always)
    assert net.get_parameter("weight") is net.weight


def test_a_parent_reads_a_running_child_through_get_parameter():
    class _Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = _Child(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.child(x)

    class _Child(nn.Linear):
        def __init__(self, parent: nn.Module) -> None:
            super().__init__(4, 4)
            self.__dict__["parent"] = parent  # (not a submodule)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = self.parent.get_parameter("child.weight")
            self.sd = self.parent.state_dict()["child.weight"]
            return super().forward(x)

    model = ampkit.initialize(_Parent(), level="O2", dtype="bfloat16")
    model(torch.randn(1, 4))
    assert model.child.seen is model.child.weight
    assert model.child.sd.dtype is FP32 and torch.equal(model.child.sd, model.child.weight)


class _Bag(nn.Module):
    """An EmbeddingBag whose per-sample weights the forward makes, in fp32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(20, 8, mode="sum")

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, by_position: bool = False
                ) -> torch.Tensor:
        psw = torch.linspace(0.5, 1.5, ids.numel())
        if by_position:
            return self.bag(ids, offsets, psw)
        return self.bag(ids, offsets, per_sample_weights=psw)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("by_position", [False, True])
def test_embedding_bag_with_per_sample_weights_made_in_the_forward(level, by_position):
    ids, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])
    psw = torch.linspace(0.5, 1.5, 5)
    with torch.autocast("cpu", BF16):  # native autocast runs it
        native = _Bag()(ids, offsets, by_position)
    assert native.dtype is FP32
    model = ampkit.initialize(_Bag(), level=level, dtype="bfloat16")
    out = model(ids, offsets, by_position)
    out.square().sum().backward()
    # Oracle: torch's kernel with the weight in its compute dtype and the per-sample
    # weights cast to it.
    weight = _Bag().bag.weight
    if level == "O3":
        weight = weight.detach().to(BF16).requires_grad_()
    ref = F.embedding_bag(ids, weight.to(BF16), offsets, mode="sum",
                          per_sample_weights=psw.to(BF16)).float()
    ref.square().sum().backward()
    assert torch.equal(out, ref)
    assert model.bag.weight.grad.dtype is weight.grad.dtype
    assert torch.equal(model.bag.weight.grad, weight.grad)
