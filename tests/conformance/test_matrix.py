"""The conformance matrix, one process: ``test_cell[<arch>-<mode>-<machinery>]``.

Each cell's id reads as a sentence: the architecture, the mode, the machinery. The
table (architectures, modes, machinery, tolerances) is in ``conformance_cells.py``;
the distributed cells are in ``test_matrix_distributed.py``. The default run collects
:data:`SUBSET` (CI); ``--conformance-all`` (or ``python -m tests.conformance --all``)
collects every cell. Inapplicable cells are skipped with the reason; a cell never
skips because it fails.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from typing import Any

import conformance_boundary
import conformance_cells as C
import conformance_truth
import pytest
import torch

CHECKS = ("dtype_invariants", "wrong_order_errors")
#: torch.compile is crossed with these modes only (a compiled cell costs 5-60 s here):
#: the fp32-truth family, its custom lists (a compiled region with lists must stay one
#: graph), pure bf16 and fp8
COMPILED_MODES = ("O1_bf16", "O1_custom_policy", "O2_bf16", "pure_bf16_stochastic",
                  "fp8_tensorwise")
CORE_MODES = [m for m in C.MODES.values() if not m.dialect]
DIALECT_MACHINERY = ("plain_steps", "grad_accumulation",
                     "eval_no_grad_inference_mode_between_steps", "data_edit_between_steps")

#: the CI subset: every architecture and every mode at least once, the crossings the
#: cases of weights changed between forwards and of torch's module machinery live in, and
#: one cell of each piece of machinery
SUBSET = {
    *((a, "O2_bf16", "data_edit_between_steps") for a in C.ARCHS),
    *((a, "O1_bf16", "plain_steps") for a in C.ARCHS),
    *((a, m, "dtype_invariants") for a in C.ARCHS
      for m in ("O2_bf16", "pure_bf16_kahan", "O3_bf16", "fp8_tensorwise")),
    *((a, m, "plain_steps") for m, a in C.DIALECT_ARCH.items()),
    ("gpt2", "O0", "plain_steps"),
    ("llama", "O1_fp16_scaler", "grad_accumulation"),
    ("bert", "O1_custom_policy", "clip_grad_norm"),
    ("gpt2", "O2_fp16_scaler", "clip_grad_norm"),
    ("tied_embeddings", "O2_bf16", "torch_compile"),
    ("parametrized_sequential", "O1_custom_policy", "torch_compile"),
    ("t5", "O2_bf16", "checkpoint_reentrant"),
    ("llama", "pure_bf16_stochastic", "checkpoint_non_reentrant"),
    ("cnn_batchnorm", "pure_bf16_stochastic", "state_dict_resume"),
    ("tied_embeddings", "pure_bf16_kahan", "torch_save_load_resume"),
    ("frozen_base_adapters", "O2_bf16", "deepcopy_resume"),
    ("cnn_batchnorm", "O2_bf16", "ema_model"),
    ("gpt2", "O2_bf16", "eval_no_grad_inference_mode_between_steps"),
    ("llama", "O2_bf16", "generate"),
    ("gpt2", "fp8_tensorwise", "plain_steps"),
    ("lstm", "O2_bf16", "wrong_order_errors"),
    # the truth during the forward, at every level and in pure mode (a tiny
    # model: about 0.2 s a cell)
    *(("truth_probe", m, mach) for m in ("O0", "O1_bf16", "O1_fp16_scaler", "O2_bf16",
                                         "O2_fp16_scaler", "O3_bf16", "pure_bf16_kahan")
      for mach in conformance_truth.MACHINERY),
    # the boundary's output rule: containers, float64, views and in-place edits of
    # inputs, backward hooks, eager and in a compiled function (a tiny model)
    *(("boundary_probe", m, mach) for m in ("O1_bf16", "O2_bf16", "O3_bf16")
      for mach in conformance_boundary.MACHINERY if mach != "serving_thread"),
    *(("boundary_probe", m, "serving_thread") for m in conformance_boundary.SERVING_MODES),
}


def inapplicable(arch: str, mode: str, machinery: str) -> str | None:
    """Why a cell cannot apply, or ``None``."""
    spec, m = C.ARCHS[arch], C.MODES[mode]
    if machinery == "generate" and not spec.decoder:
        return f"{arch} is not a decoder with generate()"
    if m.fp8 and not spec.fp8_layers and machinery != "dtype_invariants":
        return (f"fp8 may convert no Linear of {arch} (the first and last are left out); "
                "that initialize refuses is the dtype_invariants cell")
    if machinery in ("torch_save_load_resume", "deepcopy_resume") and arch == (
            "parametrized_sequential"):
        return ("torch itself refuses to pickle or deepcopy parametrized modules "
                "(state_dict only); the state_dict_resume cell covers it")
    if m.native_region:
        why = native_cannot_run(arch, m.low)
        if why is not None:
            return f"{why}; {mode} computes inside native autocast, so it cannot either"
    if machinery == "serving_thread" and mode not in conformance_boundary.SERVING_MODES:
        return ("O1, native autocast and the modes built on them share torch's autocast "
                "weight-cast cache between threads, so a serving thread changes their "
                "training (docs/levels.md); O2 and O3 are crossed")
    if machinery == "wrong_order_errors" and mode == "O0":
        return "O0 converts nothing, so no order of calls around it can be wrong"
    return None


@functools.cache
def native_cannot_run(arch: str, low: torch.dtype) -> str | None:
    """Why native ``torch.autocast("cpu", low)`` cannot run a training forward of
    ``arch`` on this CPU (what it raises), or ``None`` where it can. Decided by running
    it, once per process: which kernels oneDNN has depends on the CPU (its fp16 LSTM
    refuses autocast's fp16 weights everywhere; on a CPU without native bf16, an
    AVX2-only one, its bf16 LSTM does too), so no list of names can say."""
    model, data = C.fresh(arch), C.batch(arch, 0)
    try:
        with warnings.catch_warnings(), torch.autocast("cpu", low):
            warnings.simplefilter("ignore")  # HF's notices
            C.loss_of(arch, model, data)
    except RuntimeError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return (f"native torch.autocast('cpu', {low}) fails on this CPU running {arch} "
                f"({first})")
    return None


def _cells(everything: bool) -> list[Any]:
    cells = []
    for mode in C.MODES.values():
        archs = [C.DIALECT_ARCH[mode.name]] if mode.dialect else list(C.ARCHS)
        machinery = DIALECT_MACHINERY if mode.dialect else (*C.MACHINERY, *CHECKS)
        for arch in archs:
            crossed = C.ARCHS[arch].machinery
            for mach in machinery:
                if mach == "torch_compile" and mode.name not in COMPILED_MODES:
                    continue  # not crossed (see COMPILED_MODES)
                if (mach in conformance_truth.MACHINERY
                        or mach in conformance_boundary.MACHINERY) and crossed is None:
                    continue  # a probe's own (an architecture that lists it)
                if crossed is not None and mach not in crossed:
                    continue  # not crossed (the architecture's own list)
                if not everything and (arch, mode.name, mach) not in SUBSET:
                    continue
                why = inapplicable(arch, mode.name, mach)
                marks = [pytest.mark.skip(reason=f"inapplicable: {why}")] if why else []
                cells.append(pytest.param(arch, mode.name, mach, marks=marks,
                                          id=f"{arch}-{mode.name}-{mach}"))
    return cells


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_cell":
        metafunc.parametrize(("arch", "mode", "machinery"),
                             _cells(metafunc.config.getoption("--conformance-all")))


@pytest.fixture(autouse=True)
def _quiet_and_closed() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's and torchao's notices; failures still raise
        try:
            yield
        finally:
            C.close_all()  # no mode's thread-wide region outlives its cell


def _close(got: list[float], ref: list[float], tolerance: str, what: str) -> None:
    rtol, atol, why = C.TOLERANCES[tolerance]
    assert len(got) == len(ref)
    record = os.environ.get("AMPKIT_CONFORMANCE_RECORD")
    if record:  # the drift each cell measured, to size TOLERANCES (see its comment)
        drift = max(abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref))
        with open(record, "a") as f:
            f.write(json.dumps({"cell": what, "tolerance": tolerance, "drift": drift}) + "\n")
    bad = [(i, g, r) for i, (g, r) in enumerate(zip(got, ref))
           if not C.within(g, r, tolerance)]
    assert not bad, (f"{what}: values (index, got, fp32) outside |d| <= {atol} + {rtol}*|ref| "
                     f"({why}): {bad}; got {got}, fp32 {ref}")


def _fp8_layers(model: torch.nn.Module) -> set[str]:
    return {n for n, mod in model.named_modules() if type(mod).__name__.startswith("Float8")}


def _check_dtypes(arch: str, mode: str) -> None:
    """Every dtype promise of the mode, all reported together."""
    m = C.MODES[mode]
    model = C.fresh(arch)
    buffers = C.floating_buffers(model)
    norm_params = C.norm_parameter_names(model)
    if m.fp8 and not C.ARCHS[arch].fp8_layers:
        # a request for fp8 that converts no layer is an error, never a silent O2 run
        with pytest.raises((ValueError, RuntimeError), match="fp8"):
            C.setup(arch, mode)
        return
    problems: list[str] = []
    run = C.setup(arch, mode)
    with C.closing(run):
        if m.fp8:  # fp8 converts what fp8_report says it converts, and something
            import ampkit

            report = ampkit.tools.fp8_report(run.model)
            # a row: the layer's name, (its type,) "IN x OUT", yes/no
            said = set(re.findall(r"^(\S+)\s+(?:\S+\s+)?\d+ x \d+\s+yes\b", report,
                                  flags=re.M))
            done = _fp8_layers(run.model)
            if not done:
                problems.append(f"fp8='tensorwise' converted no layer of {arch}:\n{report}")
            if said != done:
                problems.append(f"fp8_report says {sorted(said)}; converted {sorted(done)}")
        C._train_step(arch, run, 0)
        params = dict(run.model.named_parameters())
        if m.truth == "fp32":
            wrong = {n: p.dtype for n, p in params.items() if p.dtype != torch.float32}
            if wrong:
                problems.append(f"{mode} keeps fp32 parameters as the truth; got {wrong}")
        else:
            # A parametrization's sources (``parametrizations.<name>.original*``, the
            # legacy hooks' ``<name>_orig``/``_g``/``_v``) stay fp32 where parameters go
            # low, as norms with statistics do: torch's parametrizations cannot compute
            # in bf16 (orthogonal's matrix_exp, spectral norm beside its fp32 u and v).
            sources = {n for n in params if ".parametrizations." in f".{n}"
                       or n.endswith(("_orig", "_g", "_v"))}
            low = {n: p.dtype for n, p in params.items() if n not in norm_params
                   and n not in sources and p.dtype != m.low}
            wrong_sources = {n: params[n].dtype for n in sources
                             if params[n].dtype != torch.float32}
            if wrong_sources:
                problems.append(f"{mode} keeps parametrization sources fp32; got "
                                f"{wrong_sources}")
            if low:
                problems.append(f"{mode} stores parameters in {m.low}; got {low}")
            norms = {n: params[n].dtype for n in norm_params if n in params
                     and params[n].dtype != torch.float32}
            if mode != "O3_bf16" and norms:  # pure bf16: norms fp32 (the level table)
                problems.append(f"{mode} keeps norms fp32; got {norms}")
        after = C.floating_buffers(run.model)
        if after != buffers:
            changed = {n: (buffers.get(n), d) for n, d in after.items() if buffers.get(n) != d}
            problems.append(f"{mode}: floating buffers keep their dtype (rotary frequencies, "
                            f"masks, running statistics); (before, after): {changed}")
        low = torch.float16 if m.low == torch.float16 else torch.bfloat16
        # where native autocast cannot run the architecture on this CPU there is no
        # native observation to compare with: the rest is checked, then the cell says so
        no_native = native_cannot_run(arch, low) if m.keeps_fp32_ops else None
        if m.keeps_fp32_ops and no_native is None:
            seen = C.observe_ops(arch, run)
            native = C.setup(arch, "native_fp16" if low == torch.float16 else "native_bf16")
            expected = C.observe_ops(arch, native)
            fewer = {op: (seen.fp32[op], n) for op, n in expected.fp32.items()
                     if seen.fp32[op] < n}
            if fewer:
                problems.append(f"{mode} runs in low precision ops native autocast runs in "
                                f"fp32 (op: (fp32 calls here, fp32 calls native)): {fewer}")
            if not seen.norm_weights <= {torch.float32}:
                problems.append(f"{mode}: norms compute with fp32 parameters; their kernels "
                                f"got {seen.norm_weights}")
    assert not problems, "\n".join(problems)
    if no_native is not None:
        pytest.skip(f"inapplicable: the comparison with native autocast's fp32 ops (every "
                    f"other dtype promise held): {no_native}")


def _check_wrong_orders(arch: str, mode: str) -> None:
    import ampkit

    run = C.setup(arch, mode)
    with C.closing(run):
        # a converted model initialized again with other settings
        other = {"level": "O1" if mode != "O1_bf16" else "O2", "dtype": torch.bfloat16}
        with pytest.raises(RuntimeError):
            ampkit.initialize(run.model, **other)
        # wrapping before initialize
        with pytest.raises(RuntimeError):
            ampkit.initialize(torch.nn.DataParallel(C.fresh(arch)), level="O2",
                              dtype=torch.bfloat16)


def test_cell(arch: str, mode: str, machinery: str) -> None:
    if machinery == "dtype_invariants":
        return _check_dtypes(arch, mode)
    if machinery == "wrong_order_errors":
        return _check_wrong_orders(arch, mode)
    m = C.MODES[mode]
    got = C.MACHINERY[machinery](arch, mode)
    fp32 = C.reference(arch, "fp32", machinery)
    if machinery == "data_edit_between_steps":
        assert got[2:] == got.twin, (
            f"{mode}: a forward after a .data edit must compute what a model newly set "
            f"up from the edited weights computes (no stale low-precision copy): "
            f"{got[2:]} != {got.twin}")
    if machinery == "loss_outside_model":  # never lower than native's, inside its region
        assert all(d == torch.float32 for d in got.dtypes), (
            f"{mode}: a loss computed outside the model ran in {got.dtypes}; native "
            f"autocast computes it in float32 inside its region")
    if machinery in C.RESUMES:  # bit for bit like the same mode, uninterrupted
        assert got == C.reference(arch, mode, machinery), (
            f"resumed run {got} != uninterrupted {C.reference(arch, mode, machinery)}")
    if m.bit_equal_to is not None:
        ref = C.reference(arch, m.bit_equal_to, machinery)
        assert got == ref, f"{mode} must equal {m.bit_equal_to} bit for bit: {got} != {ref}"
    _close(got, fp32, m.tolerance,
           f"{arch} {mode} {machinery} against fp32")
