"""The multi-tensor rounding step of pure bf16 training: stochastic rounding
and Kahan's compensation over a whole chunk at once, with random bits drawn per block of
each parameter from a generator seeded by (seed, parameter, step, block), so a run is
bit for bit the same whatever the chunking, across a save and resume, and for a shard
of a parameter."""

from __future__ import annotations

import io
import math

import pytest
import torch

from ampkit.pure import PureLowPrecisionOptimizer
from ampkit.pure.rounding import (
    Positions,
    draw_noise,
    nearest_bits,
    round_kahan,
    round_kahan_foreach,
    round_stochastic,
)
from ampkit.pure.step import slice_size, slices

BF16 = torch.bfloat16


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above fp32 ``x``, from its bit pattern (an
    oracle independent of the code under test)."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    away = (down.to(BF16).view(torch.int16) + 1).view(BF16).float()
    up = torch.where(down == x, down, away)
    return torch.minimum(down, up), torch.maximum(down, up)


def _round(values: list[torch.Tensor], key: tuple[int, ...]) -> list[torch.Tensor]:
    outs = [torch.empty_like(v, dtype=BF16) for v in values]
    round_stochastic([(Positions(v), key, [out], [v.clone()])
                      for v, out in zip(values, outs)])
    return outs


def test_the_multi_tensor_rounding_is_unbiased_and_lands_on_a_neighbour():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=gen) * 10.0 ** torch.randint(-6, 4, (64,), generator=gen)
    y = -x[:16].clone()  # a second tensor in the same call; negatives round alike
    lo, hi = _neighbours(x)
    draws = torch.stack([_round([x, y], (0, 0, k))[0].float() for k in range(4000)])
    assert bool(((draws == lo) | (draws == hi)).all())
    gap = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)
    expected = torch.where(hi == lo, torch.zeros_like(x), (x - lo) / gap).double()
    share_up = (draws == hi).double().mean(0)
    assert (share_up - expected).abs().max().item() < 0.035  # ~4.4 sigma at n=4000
    neg = torch.stack([_round([x, y], (0, 0, k))[1].float() for k in range(200)])
    assert torch.equal(neg, -torch.stack([_round([x, y], (0, 0, k))[0][:16].float()
                                          for k in range(200)]))


def test_exact_values_infinities_and_every_nan_payload_survive():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), -float("inf"),
                          3.3895313892515355e38])  # bf16's largest finite
    # NaNs whose payload would carry into the sign or truncate to an infinity
    nans = torch.tensor([0x7FFFFFFF, 0x7F800001, -1, 0x7FC00000, -0x7F0001],
                        dtype=torch.int32).view(torch.float32)
    for k in range(50):
        out_exact, out_nan = _round([exact, nans], (1, 2, k))
        assert torch.equal(out_exact.float(), exact)
        assert bool(out_nan.isnan().all()), out_nan


def test_kahan_over_many_tensors_keeps_what_rounding_lost_truncated():
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(7, 5, generator=gen) * 3, torch.randn(3, generator=gen),
              torch.randn(4, 6, generator=gen).t()]  # a non-contiguous one
    outs = [torch.empty_like(v, dtype=BF16) for v in values]
    comps = [torch.empty_like(v, dtype=BF16) for v in values]
    round_kahan_foreach(outs, [v.clone() for v in values], comps)
    for v, out, comp in zip(values, outs, comps):
        nearest = v.to(BF16)
        lost = ((v - nearest.float()).view(torch.int32) & -65536).view(torch.float32)
        assert torch.equal(out, nearest) and torch.equal(comp.float(), lost)
        assert torch.equal((out.float() + comp.float()).to(BF16), out)


# -- the random bits ------------------------------------------------------------------

def test_a_shard_draws_the_bits_of_its_elements_in_the_whole_parameter():
    whole = torch.empty(300, 700)  # 210,000 elements: four blocks of the stream
    full = draw_noise(Positions(whole), (3, 1, 4), 4, whole.device)
    assert full.shape == (4, 300, 700) and full.dtype is torch.int32
    assert int(full.min()) >= 0 and int(full.max()) < 1 << 16
    rows = Positions(whole)  # rows 100..199: Shard(0)'s contiguous run
    rows.local_shape, rows.block_start = (100, 700), 100 * 700
    assert torch.equal(draw_noise(rows, (3, 1, 4), 4, whole.device), full[:, 100:200])
    cols = Positions(whole)  # columns 300..399: scattered positions
    cols.local_shape, cols.block_start, cols.offset = (300, 100), None, (0, 300)
    assert torch.equal(draw_noise(cols, (3, 1, 4), 4, whole.device), full[:, :, 300:400])
    # the jobs draw different bits, and another key other bits
    assert not torch.equal(full[0], full[1])
    assert not torch.equal(draw_noise(Positions(whole), (3, 1, 5), 4, whole.device), full)


def test_drawing_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    draw_noise(Positions(torch.empty(1000)), (0, 0, 0), 3, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)


# -- whole steps: chunking and resume -------------------------------------------------

def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 300k elements: five blocks of the stream, and two slices when chunk_bytes is
    # small (an element-wise optimizer then steps them one at a time)
    net = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(),
                              torch.nn.Linear(300, 1000), torch.nn.Tanh(),
                              torch.nn.Linear(1000, 3))
    return net.to(BF16)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g))
            for _ in range(n)]


def _optimizer(model: torch.nn.Module, name: str, rounding: str,
               chunk_bytes: int | None) -> torch.optim.Optimizer:
    params = model.parameters()
    inner = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
             "sgd": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
             "nadam": lambda: torch.optim.NAdam(params, lr=1e-3)}[name]()
    return PureLowPrecisionOptimizer(inner, rounding, seed=11, chunk_bytes=chunk_bytes)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer,
           batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x.to(BF16)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _grad(model: torch.nn.Module) -> torch.Tensor:
    weight = model[2].weight
    weight.grad = torch.ones_like(weight)
    return weight


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for _, v in sorted(opt.state[p].items())
                if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "nadam"])
def test_a_run_is_bit_for_bit_the_same_whatever_the_chunk_size(rounding, name):
    batches = _batches(4)
    runs = []
    # a chunk per parameter (the large one in slices) .. one chunk, no slices
    for chunk_bytes in (1, 16 * 300 * 16, None, 1 << 30):
        model = _model()
        opt = _optimizer(model, name, rounding, chunk_bytes)
        _train(model, opt, batches)
        runs.append(_snapshot(model, opt))
    first = runs[0]
    assert all(len(r) == len(first) and all(torch.equal(a, b) for a, b in zip(r, first))
               for r in runs[1:])
    start = [p.detach() for p in _model().parameters()]
    moved = sum(int((a != b).sum()) for a, b in zip(first, start))
    assert moved > 0.5 * sum(p.numel() for p in start)  # the steps did change the weights
    # the first run did step the large weight in slices, the last one whole
    assert slices(_optimizer(_model(), name, rounding, 1), _grad(_model()), slice_size(1))
    assert slices(_optimizer(_model(), name, rounding, 1), _grad(_model()),
                  slice_size(1 << 30)) is None


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_resumed_run_with_another_chunk_size_continues_bit_for_bit(rounding):
    batches = _batches(6)
    model = _model()
    opt = _optimizer(model, "adamw", rounding, None)
    _train(model, opt, batches)
    expected = _snapshot(model, opt)

    model = _model()
    opt = _optimizer(model, "adamw", rounding, 1)
    _train(model, opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _model()
    opt = _optimizer(resumed, "adamw", rounding, 1 << 30)
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _train(resumed, opt, batches[3:])
    got = _snapshot(resumed, opt)
    assert len(got) == len(expected) and all(torch.equal(a, b)
                                             for a, b in zip(got, expected))


def test_the_seed_decides_the_bits():
    def run(seed: int) -> list[torch.Tensor]:
        model = _model()
        opt = PureLowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2),
                                        "stochastic", seed=seed)
        _train(model, opt, _batches(2))
        return [p.detach() for p in model.parameters()]

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    differ = sum(int((x != y).sum()) for x, y in zip(a, c))
    assert differ > 0.01 * sum(math.prod(x.shape) for x in a)


def _kahan_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    edges = torch.tensor([0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8),
                          3.3961e38, -3.3961e38, 3.3895e38, float("inf"), -float("inf"),
                          1e-40, -3e-39, 2.0 ** -133])  # ties, overflow, subnormals
    return torch.cat([torch.randn(200, generator=gen) * 3,
                      torch.randn(50, generator=gen) * 1e-30, edges])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype is BF16 else torch.int32)


def test_kahan_nearest_bits_equal_torchs_conversion():
    values = torch.cat([_kahan_inputs(), torch.randint(
        -2 ** 31, 2 ** 31 - 1, (20000,), generator=torch.Generator().manual_seed(4),
        dtype=torch.int32).view(torch.float32)])  # every kind of bit pattern
    rounded = nearest_bits(values)
    finite = ~values.isnan()
    assert torch.equal(rounded[finite], values[finite].to(BF16).float())
    assert bool(rounded[~finite].isnan().all()) and int((~finite).sum()) > 0


def test_kahan_rounding_under_torch_compile_keeps_the_compensation():
    # inductor fuses a float round trip to bf16 and back away; the compensation (what
    # the rounding lost) must stay the eager one, bit for bit
    values = _kahan_inputs()
    nan = torch.tensor([float("nan"), 1.5])

    def both(x: torch.Tensor, y: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
        weight, lost = round_kahan(x.clone())
        outs = [torch.empty_like(x, dtype=BF16), torch.empty_like(y, dtype=BF16)]
        comps = [torch.empty_like(x, dtype=BF16), torch.empty_like(y, dtype=BF16)]
        round_kahan_foreach(outs, [x.clone(), y.clone()], comps)
        return weight, lost, outs[0], comps[0], outs[1], comps[1]

    torch._dynamo.reset()
    try:
        compiled = torch.compile(both, fullgraph=True, dynamic=False)(values, nan)
    finally:
        torch._dynamo.reset()
    eager = both(values, nan)
    assert eager[1][:200].abs().min() > 0  # there is something to lose
    for got, want in zip(compiled[:4], eager[:4]):
        # (an infinity loses inf - inf: NaN, whose payload torch's conversions vary)
        nan_at = want.isnan()
        assert got.dtype == want.dtype and torch.equal(got.isnan(), nan_at)
        assert torch.equal(_bits(got)[~nan_at], _bits(want)[~nan_at])
    assert bool(compiled[4][0].isnan()) and compiled[4][1].item() == 1.5
    assert compiled[5][1].item() == 0.0
