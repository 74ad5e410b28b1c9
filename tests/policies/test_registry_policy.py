"""The op registry and the Policy object."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.policies.policy import Policy
from ampkit.policies.registry import all_op_names, entry_points, op_name_of, resolve_op, resolve_ops


def test_every_entry_point_of_an_op_is_registered() -> None:
    assert set(entry_points("add")) >= {torch.add, torch.Tensor.add, torch.Tensor.__add__,
                                        torch.Tensor.__radd__}
    assert set(entry_points("matmul")) >= {torch.matmul, torch.Tensor.matmul,
                                           torch.Tensor.__matmul__}
    assert set(entry_points("softmax")) >= {torch.softmax, F.softmax, torch.Tensor.softmax}
    assert F.linear in entry_points("linear")
    assert torch.linalg.inv in entry_points("linalg_inv")
    assert torch.fft.fft in entry_points("fft_fft")
    assert set(entry_points("cat")) >= {torch.cat, torch.concat}  # synonyms share a name


def test_native_autocast_ops_are_known() -> None:
    from ampkit.engine.regions import native_op_names

    public = {n for n in native_op_names("cpu") if not n.startswith("_")}
    # the few names torch exposes to Python only under another spelling
    assert public - all_op_names() <= {"cross_entropy_loss", "nll_loss2d",
                                       "multilabel_margin_loss_forward",
                                       "reflection_pad1d", "reflection_pad2d",
                                       "replication_pad1d", "replication_pad2d",
                                       "replication_pad3d"}


def test_in_place_variants_are_not_entry_points() -> None:
    assert op_name_of(torch.Tensor.add_) is None
    assert op_name_of(torch.Tensor.__iadd__) is None
    assert torch.Tensor.add_ not in entry_points("add")


def test_aliases_are_per_framework() -> None:
    assert resolve_op("mul") == ("mul",)  # torch's elementwise mul
    assert "mm" in resolve_op("mul", framework="paddle")  # Paddle's matrix mul
    assert resolve_op("elementwise_mul", framework="paddle") == ("mul",)
    assert set(resolve_op("Convolution", framework="mxnet")) == {"conv1d", "conv2d", "conv3d"}
    assert resolve_op("Dense", framework="mindspore") == ("linear",)
    with pytest.raises(ValueError, match="unknown op name 'elementwise_add'"):
        resolve_op("elementwise_add")  # not a torch name without the framework
    with pytest.raises(ValueError, match="framework must be one of"):
        resolve_op("add", framework="jax")


def test_unknown_names_suggest_close_ones() -> None:
    with pytest.raises(ValueError) as err:
        resolve_op("layernorm", argument="fp32_ops")
    assert "fp32_ops" in str(err.value) and "'layer_norm'" in str(err.value)


def test_module_classes_and_subclasses() -> None:
    class MyLinear(nn.Linear):
        pass

    assert resolve_op(MyLinear) == ("linear",)
    with pytest.raises(TypeError, match="accepted classes"):
        resolve_op(nn.Identity)


def test_resolve_ops_rejects_bare_string() -> None:
    with pytest.raises(TypeError, match="expected a set, list or tuple"):
        resolve_ops("add")


def test_policy_is_immutable_and_hashable() -> None:
    p = Policy(lower_precision_ops=["linear"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "other"  # type: ignore[misc]
    assert isinstance(p.lower_precision_ops, frozenset)
    assert hash(p) == hash(Policy(lower_precision_ops={"linear"}))


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="in both lower_precision_ops and fp32_ops"):
        Policy(lower_precision_ops={"add"}, fp32_ops={torch.add})
    with pytest.raises(ValueError, match=r"unlisted must be one of \['native', 'keep'"):
        Policy(unlisted="fp64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype must be torch\.float16 or torch\.bfloat16"):
        Policy(dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown policy keys \\['colour'\\]"):
        Policy.from_dict({"colour": "red"})


def test_default_policy_is_native() -> None:
    assert ampkit.get_policy("torch").is_native
    assert not ampkit.get_policy("conservative").is_native


def test_register_policy_refuses_silent_overwrite() -> None:
    p = Policy("test-registry-unique", fp32_ops={"exp"})
    ampkit.register_policy(p)
    ampkit.register_policy(p)  # same policy again: fine
    with pytest.raises(ValueError, match="already registered"):
        ampkit.register_policy(Policy("test-registry-unique", fp32_ops={"log"}))
    with pytest.raises(TypeError, match="Policy"):
        ampkit.register_policy("conservative")  # type: ignore[arg-type]


def test_conservative_preset_documented_lists_match(tmp_path: object) -> None:
    """docs/policies.md writes the preset's lists out; they must not drift."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "policies.md").read_text()
    p = ampkit.get_policy("conservative")
    for label, ops in (("lower precision", p.lower_precision_ops), ("float32", p.fp32_ops),
                       ("promote", p.promote_ops)):
        line = next(ln for ln in doc.splitlines() if ln.startswith(f"| {label} |"))
        listed = {s.strip(" `") for s in line.split("|")[2].split(",")}
        assert listed == set(ops), label


def test_builtins_equal_under_two_names_share_one_name_and_rule() -> None:
    assert torch.dsmm == torch.mm  # one C function under two names
    assert resolve_op("dsmm") == resolve_op("spmm") == ("mm",)
    assert op_name_of(torch.dsmm) == op_name_of(torch.mm) == "mm"
    # a rule for mm must not be overwritten by the unlisted rule of its other name
    p = Policy(lower_precision_ops={"mm"}, unlisted="fp32")
    with ampkit.autocast("cpu", torch.bfloat16, policy=p):
        assert torch.mm(torch.rand(2, 2), torch.rand(2, 2)).dtype == torch.bfloat16


def test_unregister_policy_removes_registered_ones_only() -> None:
    ampkit.register_policy(Policy("test-short-lived", fp32_ops={"exp"}))
    assert "test-short-lived" in ampkit.available_policies()
    ampkit.unregister_policy("test-short-lived")
    assert "test-short-lived" not in ampkit.available_policies()
    with pytest.raises(KeyError, match="no policy is registered as 'test-short-lived'"):
        ampkit.unregister_policy("test-short-lived")
    with pytest.raises(ValueError, match="'torch' is one of the presets ampkit ships"):
        ampkit.unregister_policy("torch")
    assert ampkit.get_policy("torch").is_native
