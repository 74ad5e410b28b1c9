"""Distributed Checkpoint for pure bf16: :class:`PureLoadPlanner`, torch's default load
planner that says why a checkpoint without pure rounding state cannot resume a pure
optimizer, and what to do instead.

A pure optimizer's ``state_dict`` holds each parameter's ``rounding_step`` and each
group's ``rounding_seed`` (see :mod:`ampkit.pure`). A checkpoint saved by any other
optimizer has neither: an O2 run's optimizer (``master_weights=True``) is an ordinary
fp32 torch optimizer. ``dcp.load`` of such a checkpoint into the state of a pure
optimizer stops at the first key it lacks, with torch's ``Missing key in checkpoint
state_dict: optim.state.<param>.rounding_step``. With ``planner=PureLoadPlanner()``
the same call names what is missing, why, and the way across: load the model's state
alone and start the pure optimizer fresh.

This module imports ``torch.distributed.checkpoint`` (about a second), so
``ampkit.pure`` imports it only when ``PureLoadPlanner`` is first used.

Example:
    >>> import tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from torch.distributed.checkpoint.state_dict import get_state_dict
    >>> from ampkit.pure import PureLoadPlanner, PureLowPrecisionOptimizer
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # not pure
    >>> folder = tempfile.mkdtemp()
    >>> dcp.save(dict(zip(("model", "optim"), get_state_dict(net, opt))),
    ...          checkpoint_id=folder)  # doctest: +ELLIPSIS
    Metadata(...)
    >>> pure_net = torch.nn.Linear(2, 1).to(torch.bfloat16)
    >>> pure_opt = PureLowPrecisionOptimizer(
    ...     torch.optim.SGD(pure_net.parameters(), lr=0.1, momentum=0.9), "stochastic")
    >>> state = dict(zip(("model", "optim"), get_state_dict(pure_net, pure_opt)))
    >>> try:
    ...     dcp.load(state, checkpoint_id=folder, planner=PureLoadPlanner())
    ... except dcp.api.CheckpointException as error:
    ...     print(str(error).splitlines()[-1][:73])
    RuntimeError: the checkpoint's optimizer state has no pure rounding state
    >>> import shutil; shutil.rmtree(folder)
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan

from ampkit.pure.step import COUNT

__all__ = ["ROUNDING_KEYS", "PureLoadPlanner", "missing_rounding_state"]

#: What a pure optimizer adds to torch's ``state_dict``, and no other optimizer
#: saves: each parameter's count of rounded updates and each group's rounding seed.
ROUNDING_KEYS: tuple[str, ...] = (COUNT, "rounding_seed")


def missing_rounding_state(wanted: Any, saved: Any) -> list[str]:
    """The flattened keys of pure rounding state that ``wanted`` (a flattened state
    dict being loaded) asks for and a checkpoint with keys ``saved`` lacks, when the
    checkpoint holds no rounding state at all but does hold the other entries beside
    those keys (the optimizer state of the same parameters and groups): a checkpoint
    of an optimizer that is not pure. Empty otherwise, for torch's own check to judge.

    Example:
        >>> from ampkit.pure.checkpoint import missing_rounding_state
        >>> saved = {"optim.state.w.step", "optim.state.w.exp_avg",
        ...          "optim.param_groups.w.lr"}
        >>> wanted = [*saved, "optim.state.w.rounding_step",
        ...           "optim.param_groups.w.rounding_seed"]
        >>> missing_rounding_state(wanted, saved)
        ['optim.state.w.rounding_step', 'optim.param_groups.w.rounding_seed']
        >>> missing_rounding_state(wanted, set())  # no optimizer state: not judged
        []
    """
    saved = set(saved)
    if any(key.rpartition(".")[2] in ROUNDING_KEYS for key in saved):
        return []  # saved by a pure optimizer: whatever else differs, torch says
    parents = {key.rpartition(".")[0] for key in saved}
    return [key for key in wanted
            if key not in saved and key.rpartition(".")[2] in ROUNDING_KEYS
            and key.rpartition(".")[0] in parents]


class PureLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` that, before torch's check of missing keys,
    refuses a checkpoint whose optimizer state has no pure rounding state, saying why
    and what to do. Everything else, including ``allow_partial_load``, is torch's.

    Pass it to ``dcp.load(..., planner=PureLoadPlanner())`` when resuming a pure bf16
    run: a checkpoint of a pure run loads exactly as with torch's default planner.

    Raises:
        RuntimeError: from ``dcp.load`` (inside torch's ``CheckpointException``, as
            torch's own missing-key error is), when the state being loaded asks for
            ``rounding_step``/``rounding_seed`` and the checkpoint's optimizer state
            has none: it was saved by an optimizer that is not pure. Not raised with
            ``allow_partial_load=True``, which keeps the fresh optimizer's entries.

    Example:
        >>> from torch.distributed.checkpoint import DefaultLoadPlanner
        >>> from ampkit.pure import PureLoadPlanner
        >>> isinstance(PureLoadPlanner(), DefaultLoadPlanner)
        True
    """

    def create_local_plan(self) -> LoadPlan:
        if not self.allow_partial_load and self.metadata is not None:
            missing = missing_rounding_state(self.state_dict,
                                             self.metadata.state_dict_metadata)
            if missing:
                names = " and ".join(repr(name) for name in ROUNDING_KEYS if any(
                    key.rpartition(".")[2] == name for key in missing))
                raise RuntimeError(
                    f"the checkpoint's optimizer state has no pure rounding state: no "
                    f"{names} ({len(missing)} keys missing, the first "
                    f"{missing[0]!r}). It was saved by an optimizer "
                    f"that is not pure (an O2 run's optimizer, master_weights=True, is "
                    f"an ordinary fp32 one), so there is no rounding count or seed to "
                    f"resume. To go on in pure bf16, load the model's state alone "
                    f"(state = {{'model': get_model_state_dict(model)}}; dcp.load(state, "
                    f"checkpoint_id=...); set_model_state_dict(model, state['model'])) "
                    f"and start the pure optimizer fresh: a new one, made after the "
                    f"load")
        return super().create_local_plan()
