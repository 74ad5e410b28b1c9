"""The tools' text tables: one helper, columns as wide as their longest cell."""

import re

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.common.text import text_table


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def _column_starts(line: str) -> list[int]:
    """Where each run of non-blank text starts (cells hold no double space)."""
    return [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", line)]


def _column_ends(line: str) -> list[int]:
    return [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_comparison_table_keeps_columns_aligned_with_a_long_op_name() -> None:
    torch.manual_seed(0)
    report = ampkit.compare(_Attention(), torch.randn(2, 4, 8), precision="O3",
                            dtype=torch.bfloat16)
    lines = report.table().splitlines()
    start = lines.index("ops ranked by error added") + 1
    block = lines[start:lines.index("", start)]
    header, rows = block[0], block[1:]
    names = [row.split()[0] for row in rows]
    assert "scaled_dot_product_attention" in names
    # "added rel error" and "calls" are right-aligned: every row ends them where the
    # header does; "worst in module" starts where the header's title starts
    header_ends = _column_ends(header)
    for row in rows:
        ends = _column_ends(row)
        assert ends[1:3] == header_ends[1:3], (header, row)
        assert row.index("'") == header.index("worst in module"), (header, row)


def test_op_stats_table_fits_aten_attention_names() -> None:
    q = torch.randn(1, 2, 4, 8)
    with ampkit.collect_op_stats() as stats:
        F.scaled_dot_product_attention(q, q, q)
    lines = stats.table().splitlines()
    long_names = [line for line in lines if "scaled_dot_product" in line]
    assert long_names  # aten's CPU attention kernel has an even longer name
    bars = {tuple(i for i, ch in enumerate(line) if ch in "|+") for line in lines}
    assert len(bars) == 1, "\n".join(lines)  # every separator in the same column


def test_text_table_aligns_and_rules() -> None:
    text = text_table(("name", "n"), [("a", 1), ("scaled_dot_product_attention", 22)],
                      footer=("all", 23), separator=" | ", rules=True)
    assert text.splitlines() == [
        "name                         |  n",
        "-----------------------------+---",
        "a                            |  1",
        "scaled_dot_product_attention | 22",
        "-----------------------------+---",
        "all                          | 23",
    ]


@pytest.mark.parametrize("kwargs,message", [
    ({"align": "lx"}, "align must have one letter 'l' or 'r' per column (2), got 'lx'"),
    ({"align": "l"}, "align must have one letter 'l' or 'r' per column (2), got 'l'"),
    ({"footer": ("only one",)}, "every row must have 2 cells, got ('only one',)"),
])
def test_text_table_refuses_a_bad_shape(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        text_table(("a", "b"), [("1", "2")], **kwargs)
    assert str(info.value) == message


def test_tune_table_columns_widen_for_wide_numbers() -> None:
    from ampkit.tools.accuracy.tune import Trial, TuneResult, aggressive_policy

    policy = aggressive_policy("bfloat16")
    trials = (Trial(0, policy, -1.23456789e100, -0.5, False, 0.25, "scaled_dot_product_attention",
                    ()),
              Trial(1, policy, 1.0, 1e-12, True, 1.0, None, ()))
    result = TuneResult(policy, True, "within tolerance", 2.0, 0.1, trials)
    lines = result.table().splitlines()
    header = lines[2]
    rows = lines[3:5]
    assert header.split()[:2] == ["trial", "metric"]
    # right-aligned numeric columns: each row's cells end where the header's titles end
    header_ends = _column_ends(header)
    for row in rows:
        assert _column_ends(row)[:5] == header_ends[:5], "\n".join(lines)
    assert rows[0].endswith("-> move scaled_dot_product_attention")
