"""ampkit.AmpConfig: one typed value for every choice, from files; policy files by
path; the GradScaler's reporting and the scheduler on skipped steps (CPU).

Oracles: the same training run driven by keywords (for a config read from a file),
hand-written expected values (the scale trajectory of a known overflow, the error
texts), and torch's own scheduler warning (fired by plain torch code, absent with
``step_scheduler``).
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

import ampkit
from ampkit import AmpConfig
from ampkit.policies.policy import Policy

yaml = pytest.importorskip("yaml")


def _full() -> AmpConfig:
    return AmpConfig(level="O2", dtype="float16", policy="conservative",
                     custom_white_list=["add"], custom_black_list=["softmax", "exp"],
                     keep_fp32_modules=["head"], loss_scale="dynamic", init_scale=1024.0,
                     growth_interval=10, hysteresis=2, min_scale=1.0, max_scale=2.0 ** 20,
                     log_skipped_steps=True, fp8="rowwise", fp8_exclude_modules=["body"],
                     fp8_first_last=True, cast_model_outputs="float16")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_config_written_to_a_file_reads_back_equal(tmp_path, suffix) -> None:
    cfg = _full()
    path = tmp_path / f"amp{suffix}"
    cfg.to_file(path)
    back = AmpConfig.from_file(path)
    assert back == cfg and back is not cfg
    assert back.dtype is torch.float16 and back.custom_black_list == ("exp", "softmax")
    assert back.cast_model_outputs is torch.float16
    assert back.fp8_exclude_modules == ("body",) and back.fp8_first_last is True
    assert AmpConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg != cfg.replace(hysteresis=3)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(**initialize_kwargs) -> list[torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = ampkit.initialize(net, opt, **initialize_kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_a_config_from_a_file_trains_the_same_as_keywords(tmp_path) -> None:
    path = tmp_path / "amp.yaml"
    AmpConfig(level="O2", dtype="bfloat16", custom_black_list=["linear"]).to_file(path)
    by_file = _train(config=str(path))
    by_keywords = _train(level="O2", dtype=torch.bfloat16, custom_black_list=["linear"])
    plain_o2 = _train(level="O2", dtype=torch.bfloat16)
    for a, b in zip(by_file, by_keywords, strict=True):
        assert torch.equal(a, b)
    # the file's list was applied: linear in fp32 changes the run
    assert any(not torch.equal(a, b) for a, b in zip(by_file, plain_o2, strict=True))


def test_a_keyword_that_contradicts_the_config_is_an_error_naming_both() -> None:
    cfg = AmpConfig(level="O2", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^level='O3' contradicts the config's "
                                         r"level='O2'; give it once$"):
        ampkit.initialize(_net(), level="O3", config=cfg)
    # the same value said twice is fine
    net = ampkit.initialize(_net(), level="O2", dtype="bf16", config=cfg)
    assert net[0].weight.dtype is torch.float32


@pytest.mark.parametrize("text,message", [
    ('{"level": "O4"}', r"amp.json: level must be one of \['O0', 'O1', 'O2', 'O3'\], "
                        r"got 'O4'"),
    ('{"level": "O2", "master_weights": "fp16"}',
     r"amp.json: master_weights must be True .* its value \['none', 'fp32', 'stochastic', "
     r"'kahan', 'true', 'false'\] .*got 'fp16'"),
    ('{"levle": "O2"}', r"amp.json: unknown AmpConfig fields \['levle'\] \(did you mean "
                        r"'level'\?\); accepted: \['level', 'dtype'"),
    ('{"dtype": "float64"}', r"amp.json: dtype must be torch.float16 or torch.bfloat16"),
    ('{"growth_interval": "often"}', r"amp.json: growth_interval must be an int >= 1"),
    ('{"fp8": "blockwise"}', r"amp.json: fp8 must be None, a torchao Float8LinearConfig or "
                             r"one of \['tensorwise', 'rowwise', 'rowwise_with_gw_hp'\]"),
    ('{"level": "O3", "dtype": "bfloat16", "fp8": "rowwise"}',
     r"amp.json: fp8 trains Linears from their fp32 parameters .* use level O0, O1 or O2"),
    ('{"fp8_first_last": true}', r"amp.json: fp8_first_last chooses which Linears train "
                                 r"in fp8, but fp8 is None; pass fp8= one of the recipes"),
    ('{"fp8": "tensorwise", "fp8_first_last": "yes"}',
     r"amp.json: fp8_first_last must be a bool, got 'yes'"),
    ('{"fp8": "tensorwise", "fp8_exclude_modules": [3]}',
     r"amp.json: fp8_exclude_modules must be a list of qualified module names"),
    ('{"cast_model_outputs": "float64"}',
     r"amp.json: cast_model_outputs must be None or one of torch.float16, torch.bfloat16, "
     r"torch.float32 .*got 'float64'"),
    ('{"policy": "fast"}', r"amp.json: policy: unknown preset 'fast'.*accepted values"),
    ('[1, 2]', r"amp.json: an ampkit config must be a mapping"),
    ('{"level": ', r"amp.json: not valid JSON"),
])
def test_a_bad_file_is_a_value_error_naming_the_field(tmp_path, text, message) -> None:
    path = tmp_path / "amp.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        AmpConfig.from_file(path)


@pytest.mark.parametrize("name", ["amp.toml", "amp", "amp.JSON5"])
def test_a_file_of_another_format_names_the_accepted_suffixes(tmp_path, name) -> None:
    # refused by its suffix, before it is read (it used to say "not valid JSON")
    path = tmp_path / name
    path.write_text('level = "O2"\n')
    suffix = name.partition(".")[2]
    got = "." + suffix.lower() if suffix else "no suffix"
    with pytest.raises(ValueError, match=(
            rf"{name}: an ampkit config file is JSON \(\.json\) or YAML \(\.yaml, \.yml\), "
            rf"and its suffix says which; got '{got}'")):
        AmpConfig.from_file(path)
    with pytest.raises(ValueError, match=r"an ampkit config file is JSON"):
        AmpConfig.from_file(tmp_path / "missing.toml")  # not FileNotFoundError
    with pytest.raises(ValueError, match=r"an ampkit config file is JSON"):
        AmpConfig(level="O2").to_file(tmp_path / "out.toml")
    assert not (tmp_path / "out.toml").exists()


def test_a_bad_yaml_file_is_a_value_error_too(tmp_path) -> None:
    path = tmp_path / "amp.yml"
    path.write_text("level: O2\ncustom_black_list: [not_an_op]\n")
    with pytest.raises(ValueError, match=r"amp.yml: .*custom_black_list.*not_an_op"):
        AmpConfig.from_file(path)
    path.write_text("level: [O2\n")
    with pytest.raises(ValueError, match=r"amp\.yml: not valid YAML"):
        AmpConfig.from_file(path)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_file_that_is_not_utf8_or_nested_too_deep_is_a_value_error_naming_it(
        tmp_path, suffix) -> None:
    # (both were a bare UnicodeDecodeError or RecursionError, without the file's name)
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes('{"level": "O2", "note": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ValueError) as caught:
        AmpConfig.from_file(path)
    assert type(caught.value) is ValueError
    assert str(caught.value) == (f"{path}: not UTF-8 text (byte 0xe9 at offset 28): an "
                                 f"ampkit config file is UTF-8 JSON or YAML")
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    path = tmp_path / f"deep{suffix}"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError) as caught:
        AmpConfig.from_file(path)
    assert type(caught.value) is ValueError
    assert str(caught.value) == (f"{path}: nested too deeply to read: an ampkit config is a "
                                 f"flat mapping of field names")


def test_a_policy_file_loads_by_path(tmp_path) -> None:
    path = tmp_path / "tuned-policy.json"
    Policy("tuned", fp32_ops={"mm"}).save(path)  # the file `ampkit tune --out` writes
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with ampkit.autocast("cpu", torch.bfloat16):
        assert torch.mm(a, b).dtype is torch.bfloat16  # native: mm runs low
    with ampkit.autocast("cpu", torch.bfloat16, policy=str(path)):
        assert torch.mm(a, b).dtype is torch.float32
    assert AmpConfig(policy=str(path)).policy == str(path)
    with pytest.raises(ValueError, match=r"neither a preset .* nor an existing policy file"):
        AmpConfig(policy=str(tmp_path / "missing.json"))


# -- GradScaler reporting --------------------------------------------------------------

def _scaler_run(values, **scaler_kwargs):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = ampkit.GradScaler("cpu", init_scale=8.0, **scaler_kwargs)
    stepped = []
    for x in values:
        scaler.scale((w * x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        stepped.append(scaler.step_scheduler(sched))
        opt.zero_grad()
    return scaler, sched, stepped


def test_the_scaler_reports_scale_skips_and_the_last_overflow_step() -> None:
    scaler, _, _ = _scaler_run([1.0, float("inf"), 1.0, float("nan"), 1.0])
    assert scaler.get_scale() == 2.0  # 8 halved twice
    assert scaler.skipped_steps == 2 and scaler.last_overflow_step == 3
    assert scaler.steps == 5
    metrics = scaler.metrics()
    assert float(metrics["loss_scale"]) == 2.0 and float(metrics["skipped_steps"]) == 2.0
    state = scaler.state_dict()
    again = ampkit.GradScaler("cpu")
    again.load_state_dict(state)
    assert again.last_overflow_step == 3 and again.steps == 5


def test_a_skipped_step_logs_one_line_when_asked(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ampkit.scaling"):
        _scaler_run([1.0, float("inf"), 1.0])
    assert caplog.records == []  # opt-in
    with caplog.at_level(logging.WARNING, logger="ampkit.scaling"):
        _scaler_run([1.0, float("inf"), 1.0], log_skipped_steps=True)
    assert [r.getMessage() for r in caplog.records] == [
        "ampkit: OVERFLOW at step 1, optimizer step skipped; loss scale 8 -> 4 "
        "(1 steps skipped so far)"]


def test_a_skipped_step_neither_warns_nor_moves_the_scheduler() -> None:
    # torch's own pattern warns on a skipped first step
    # (https://github.com/pytorch/pytorch/issues/44511) ...
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = ampkit.GradScaler("cpu")
    scaler.scale((w * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    with pytest.warns(UserWarning, match="Detected call of `lr_scheduler.step"):
        sched.step()
    # ... step_scheduler neither warns nor advances; on_skip=True advances quietly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler, sched, stepped = _scaler_run([float("inf"), 1.0, float("inf")])
        assert stepped == [False, True, False]
        assert sched.get_last_lr() == [0.05]
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = ampkit.GradScaler("cpu")
    scaler.scale((w * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scaler.step_scheduler(sched, on_skip=True)
    assert sched.get_last_lr() == [0.05]


def test_a_scaler_in_a_bfloat16_run_keeps_scale_one_and_still_skips() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    scaler = ampkit.GradScaler("cpu")
    with ampkit.autocast("cpu", torch.bfloat16), pytest.warns(
            UserWarning, match="bfloat16 run .* The scale stays 1.0"):
        loss = scaler.scale((w * 2).sum())
    assert loss.item() == 4.0  # not multiplied by 65536
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [0.0, 0.0] and scaler.get_scale() == 1.0
    scaler.scale((w * float("inf")).sum()).backward()  # an overflow is still skipped
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [0.0, 0.0] and scaler.skipped_steps == 1
    assert scaler.get_scale() == 1.0  # static
    forced = ampkit.GradScaler("cpu", scale_bfloat16=True)
    with ampkit.autocast("cpu", torch.bfloat16):
        assert forced.scale(w.sum() + 1).item() == 65536.0


def test_a_config_object_holds_fp8_recipes_by_name_only() -> None:
    # A config goes to files; a torchao config object does not, so it is refused with
    # the way to pass one.
    with pytest.raises(TypeError, match=r"fp8 must be None or a recipe name, one of "
                                        r"\['tensorwise', .*pass a Float8LinearConfig to "
                                        r"ampkit.initialize\(fp8=...\) directly"):
        AmpConfig(level="O2", dtype="bfloat16", fp8=object())
    assert AmpConfig(level="O2", dtype="bfloat16", fp8="RowWise").fp8 == "rowwise"


def test_a_config_with_fp8_trains_its_linears_in_fp8() -> None:
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)]).to("cpu")
    cfg = AmpConfig(level="O2", dtype="bfloat16", fp8="tensorwise")
    net = ampkit.initialize(net, config=cfg)
    # the middle Linear (first and last stay out by default) is torchao's Float8Linear
    assert [type(m).__name__ for m in net] == ["Linear", "Float8Linear", "Linear"]
    assert ampkit.fp8.get_fp8_plan(net).converted == ("1",)


@pytest.mark.parametrize("bad", [
    {"fp8_first_last": True},
    {"fp8": "tensorwise", "fp8_first_last": "yes"},
    {"fp8_exclude_modules": ["0"]},
    {"cast_model_outputs": "float64"},
    {"cast_model_outputs": "int8"},
])
def test_the_new_fields_are_refused_with_initializes_own_words(bad) -> None:
    # One wording per field: the config runs the checks initialize runs, so a bad
    # value reads the same whichever way it is given.
    pytest.importorskip("torchao.float8")
    with pytest.raises((TypeError, ValueError)) as by_keyword:
        ampkit.initialize(_net(), level="O2", dtype="bfloat16", **bad)
    with pytest.raises(type(by_keyword.value)) as by_config:
        AmpConfig(level="O2", dtype="bfloat16", **bad)
    assert str(by_config.value) == str(by_keyword.value)
    name = "fp8_exclude_modules" if "fp8_exclude_modules" in bad else (
        "fp8_first_last" if "fp8_first_last" in bad else "cast_model_outputs")
    assert str(by_config.value).startswith(name)


def _fp8_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)]).to("cpu")


def _train_fp8(**initialize_kwargs) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    net = _fp8_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = ampkit.initialize(net, opt, **initialize_kwargs)
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for _ in range(3):
        out = net(torch.randn(8, 16, generator=gen))
        outputs.append(out.detach())
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return net, outputs + [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_file_with_the_fp8_and_output_fields_trains_as_the_keywords(tmp_path,
                                                                      suffix) -> None:
    pytest.importorskip("torchao.float8")
    chosen = dict(fp8="tensorwise", fp8_exclude_modules=["1"], fp8_first_last=True,
                  cast_model_outputs="bfloat16")
    path = tmp_path / f"amp{suffix}"
    AmpConfig(level="O2", dtype="bfloat16", **chosen).to_file(path)
    by_file, a = _train_fp8(config=str(path))
    by_keywords, b = _train_fp8(level="O2", dtype=torch.bfloat16, **chosen)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    # each field took effect: first and last in fp8, the excluded middle one not, and
    # outputs in bf16 where O2 alone gives float32
    assert [type(m).__name__ for m in by_file] == ["Float8Linear", "Linear", "Float8Linear"]
    assert [type(m) for m in by_keywords] == [type(m) for m in by_file]
    assert a[0].dtype is torch.bfloat16
    plain, c = _train_fp8(level="O2", dtype=torch.bfloat16, fp8="tensorwise")
    assert [type(m).__name__ for m in plain] == ["Linear", "Float8Linear", "Linear"]
    assert c[0].dtype is torch.float32
