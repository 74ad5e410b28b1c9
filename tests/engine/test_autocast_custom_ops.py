"""Custom ops (torch.library) in custom lists, by object and by "ns::name",
in eager code and under torch.compile."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ampkit
from ampkit.policies.registry import entry_points, resolve_op

BF16, F32 = torch.bfloat16, torch.float32


@torch.library.custom_op("ampkit_test::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


ENTRIES: dict[str, Callable[[], object]] = {
    "object": lambda: scale,
    "qualified-name": lambda: "ampkit_test::scale",
    "ops-packet": lambda: torch.ops.ampkit_test.scale,
    "ops-overload": lambda: torch.ops.ampkit_test.scale.default,
}


@pytest.mark.parametrize("entry", list(ENTRIES), ids=list(ENTRIES))
def test_every_spelling_resolves_to_the_qualified_name(entry: str) -> None:
    assert resolve_op(ENTRIES[entry]()) == ("ampkit_test::scale",)  # type: ignore[arg-type]


@pytest.mark.parametrize("entry", list(ENTRIES), ids=list(ENTRIES))
def test_custom_op_in_white_and_black_lists(entry: str) -> None:
    x = torch.rand(5)
    with ampkit.autocast("cpu", BF16, custom_white_list=[ENTRIES[entry]()]):
        out = scale(x, 3.0)
        assert out.dtype == BF16 and torch.ops.ampkit_test.scale(x, 3.0).dtype == BF16
    torch.testing.assert_close(out, x.bfloat16() * 3.0, rtol=0, atol=0)
    with ampkit.autocast("cpu", BF16, custom_black_list=[ENTRIES[entry]()]):
        assert scale(x.bfloat16(), 3.0).dtype == F32
    assert scale(x, 3.0).dtype == F32  # outside: its inputs' dtype


def test_custom_op_lists_under_torch_compile() -> None:
    x = torch.rand(5)
    fn = torch.compile(lambda t: scale(t, 2.0) + 1, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with ampkit.autocast("cpu", BF16, custom_white_list=[scale]):
        low = fn(x)
    with ampkit.autocast("cpu", BF16, custom_black_list=["ampkit_test::scale"]):
        high = fn(x.bfloat16())
    assert low.dtype == BF16 and high.dtype == F32
    torch.testing.assert_close(low, x.bfloat16() * 2.0 + 1, rtol=0, atol=0)
    assert fn(x).dtype == F32


def test_unknown_custom_op_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"custom_white_list: unknown custom op "
                                         r"'ampkit_test::nope'"):
        ampkit.autocast("cpu", custom_white_list=["ampkit_test::nope"])


def test_aten_qualified_names_are_the_canonical_ops() -> None:
    assert resolve_op("aten::softmax") == ("softmax",)
    assert resolve_op(torch.ops.aten.mm) == ("mm",)
    # aten overloads are what compiled graphs call: never an entry point of their op
    assert torch.ops.aten.mm.default not in entry_points("mm")
