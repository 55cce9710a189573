"""Bad input of every kind ends in ONE line naming the flag or field, the value and a fix.

The readers of user files (a trace, a config.json) are fed generated garbage: raw bytes, text
that is not UTF-8, deep nesting, wrong types, empty objects, endless numbers. Each either
returns a valid result or raises the one config error (``HybridKVConfigError`` or the spec's
``ConfigError``) with a one-line message; never another exception. Then the cases a user met
go through the command line, which must exit 2 with one line on stderr and no traceback.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.cli.main import main
from hybridkv.cli.plan import build_plan
from hybridkv.errors import HybridKVConfigError
from hybridkv.simulator import run as sim_run
from hybridkv.simulator.limits import MAX_STEPS, check_run_memory
from hybridkv.simulator.model_config import load_model_config
from hybridkv.simulator.run import SimOptions
from hybridkv.testbed.trace import TraceRequest, load_trace
from hybridkv.testbed.workloads import builtin_workload
from spec.errors import ConfigError
from spec.presets import PRESETS, preset_config

MAX_MESSAGE = 1200  # field, value, problem and fix, each cut to a readable length
NESTING = [10, 500, 5_000, 100_000]  # 100,000 is past any JSON reader's recursion

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["", "auto", "mamba", "float32", "linear_attention", "x" * 5_000]),
)
_junk = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _huge_int(digits: int) -> str:
    return "9" * digits


def _assert_one_line(err: Exception) -> None:
    text = str(err)
    assert "\n" not in text, text[:200]
    assert "\r" not in text, text[:200]
    assert len(text) <= MAX_MESSAGE, len(text)
    assert isinstance(err, HybridKVConfigError | ConfigError)
    assert err.field, text[:200]
    assert text.rsplit(";", 1)[-1].strip() not in {"", "fix", "fix it"}, text[:200]


def _config_text(data: st.DataObject) -> bytes:
    """A config.json's bytes: a preset with junk fields, or garbage outright."""
    kind = data.draw(st.sampled_from(["preset", "bytes", "not-utf8", "deep", "empty", "number"]))
    if kind == "bytes":
        return data.draw(st.binary(max_size=64))
    if kind == "deep":
        return _deep(data.draw(st.sampled_from(NESTING))).encode()
    if kind == "empty":
        return data.draw(st.sampled_from([b"", b"{}", b"[]", b"null", b"\n"]))
    if kind == "number":
        digits = _huge_int(data.draw(st.sampled_from([5, 4_299, 5_000])))
        return f'{{"architectures": ["GptOssForCausalLM"], "num_hidden_layers": {digits}}}'.encode()
    config = copy.deepcopy(dict(preset_config(data.draw(st.sampled_from(sorted(PRESETS))))))
    text = config.get("text_config", config)
    keys = [*sorted(text), "architectures", "text_config"]
    for key in data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        target = config if key in ("architectures", "text_config") else text
        if data.draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = data.draw(_junk)
    raw = json.dumps(config).encode()
    if kind == "not-utf8":
        cut = data.draw(st.integers(0, len(raw)))
        return (
            raw[:cut] + data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[cut:]
        )
    return raw


@settings(max_examples=settings().max_examples * 2, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_config_reader_and_plan_take_any_bytes(data: st.DataObject) -> None:
    raw = _config_text(data)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_bytes(raw)
        try:
            source, config = load_model_config(None, str(path))
            plan = build_plan(config, source=source, max_model_len=8192)
        except (HybridKVConfigError, ConfigError) as err:
            _assert_one_line(err)
            return
    assert plan["groups"], plan  # valid: a geometry with at least one group


_trace_keys = st.sampled_from(
    ["arrival_step", "prompt", "max_tokens", "cache_salt", "conversation", "x" * 300]
)


def _trace_line(data: st.DataObject) -> str:
    kind = data.draw(st.sampled_from(["object", "deep", "number", "text", "valid"]))
    if kind == "deep":
        return _deep(data.draw(st.sampled_from(NESTING)))
    if kind == "number":
        return f'{{"arrival_step": {_huge_int(5_000)}, "prompt": [1], "max_tokens": 1}}'
    if kind == "text":
        return data.draw(st.text(max_size=30))
    if kind == "valid":
        return '{"arrival_step": 0, "prompt": [1, 2], "max_tokens": 2}'
    obj = data.draw(st.dictionaries(_trace_keys, _junk, max_size=5))
    return json.dumps(obj)


@settings(max_examples=settings().max_examples * 2, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_trace_reader_takes_any_bytes(data: st.DataObject) -> None:
    lines = [_trace_line(data) for _ in range(data.draw(st.integers(0, 4)))]
    raw = "\n".join(lines).encode()
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=64)) if data.draw(st.booleans()) else raw + b"\n\xff\xfe"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.jsonl"
        path.write_bytes(raw)
        try:
            trace = load_trace(path)
        except HybridKVConfigError as err:
            _assert_one_line(err)
            return
    assert trace
    assert all(isinstance(r, TraceRequest) for r in trace)


@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plan_command_takes_any_config_file(data: st.DataObject) -> None:
    raw = _config_text(data)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_bytes(raw)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", "--config", str(path), "--max-model-len", "8192", "--json"])
    if code == 0:
        assert json.loads(out.getvalue())["groups"]
        return
    assert code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hybridkv plan: error: "), lines


# --- the cases a user met, through the command line -------------------------------------------


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert len(lines[0]) <= MAX_MESSAGE + 40
    return lines[0]


def _preset_file(tmp_path: Path, name: str, **changes: Any) -> str:
    config = copy.deepcopy(dict(preset_config(name)))
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


def test_config_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"architectures": ["\xff"]}')
    line = _one_error_line(capsys, ["plan", "--config", str(path)])
    assert f"--config='{path}': is not UTF-8 text (line 1, byte 20: invalid start byte" in line


def test_config_nested_past_the_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(_deep(100_000), encoding="utf-8")
    line = _one_error_line(capsys, ["plan", "--config", str(path)])
    assert "nests arrays or objects deeper than a JSON reader can follow" in line


def test_architectures_holding_a_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _preset_file(tmp_path, "gpt-oss-20b", architectures=[["GptOssForCausalLM"]])
    line = _one_error_line(capsys, ["plan", "--config", path])
    assert "config.json:architectures=[['GptOssForCausalLM']]" in line
    assert "use one of " in line
    assert "FalconH1ForCausalLM" in line
    assert "GptOssForCausalLM," in line


def test_a_config_without_kv_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _preset_file(tmp_path, "nemotron-h-8b", hybrid_override_pattern="-" * 52)
    line = _one_error_line(capsys, ["plan", "--config", path])
    assert "config.json:hybrid_override_pattern=" in line
    assert "has no mamba (M) or attention (*) layer" in line


@pytest.mark.parametrize(
    ("preset", "bad", "known"),
    [
        ("granite-4.0-h-tiny", "sliding_attention", "mamba, attention"),
        ("gemma-3-1b", "mamba", "sliding_attention, full_attention"),
        ("gemma-3-1b", ["full_attention"], "sliding_attention, full_attention"),
    ],
)
def test_unknown_layer_types_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: str, bad: object, known: str
) -> None:
    types = list(preset_config(preset)["layer_types"])
    types[3] = bad
    line = _one_error_line(
        capsys, ["plan", "--config", _preset_file(tmp_path, preset, layer_types=types)]
    )
    assert f"config.json:layer_types[3]={bad!r}: is not a layer type" in line
    assert line.endswith(f"use one of {known}")


def test_unknown_layer_types_of_qwen_are_refused() -> None:
    config = copy.deepcopy(dict(preset_config("qwen3.5-27b")))
    config["text_config"]["layer_types"][0] = "sliding_attention"
    with pytest.raises(ConfigError, match=r"layer_types\[0\]='sliding_attention'"):
        build_plan(config, source="test")


def test_a_50_mb_value_is_cut_in_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    line = {"arrival_step": "s" * 50_000_000, "prompt": [1], "max_tokens": 1}
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    message = _one_error_line(capsys, ["simulate", "--trace", str(path)])
    assert f"{path}:1: arrival_step='sssss" in message
    assert "sss...sss" in message
    assert message.endswith("sss': must be an int >= 0; write arrival_step as a JSON integer >= 0")
    assert len(message) < 400


def test_a_50_mb_string_in_a_config_is_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _preset_file(tmp_path, "gemma-3-1b", torch_dtype="x" * 10_000_000)
    line = _one_error_line(capsys, ["plan", "--config", path])
    assert line.startswith("hybridkv plan: error: config.json:torch_dtype='xxxx")
    assert "..." in line
    assert len(line) < 400


def test_a_far_arrival_is_named_not_called_a_liveness_bug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    far = {"arrival_step": 10**12, "prompt": [1, 2, 3], "max_tokens": 2}
    path.write_text(json.dumps(far) + "\n", encoding="utf-8")
    line = _one_error_line(capsys, ["simulate", "--preset", "gemma-3-1b", "--trace", str(path)])
    assert f"arrival_step={10**12}: is past the {MAX_STEPS} steps" in line
    assert "liveness" not in line


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["plan", "--max-model-len", "0"], "--max-model-len=0: must be an int >= 1; pass e.g."),
        (["simulate", "--max-model-len", "0"], "--max-model-len=0: must be an int >= 1; pass e.g."),
        (["simulate", "--gpu-blocks", "0"], "--gpu-blocks=0: must be an int >= 1"),
        (
            ["simulate", "--requests", "0", "--trace", "x.jsonl"],
            "--requests=0: must be an int >= 1",
        ),
        (["simulate", "--layers-per-group", "-1"], "--layers-per-group=-1: must be an int >= 1"),
    ],
)
def test_number_flags_are_named_as_typed(
    capsys: pytest.CaptureFixture[str], argv: list[str], start: str
) -> None:
    line = _one_error_line(capsys, argv)
    assert line.startswith(f"hybridkv {argv[0]}: error: {start}"), line
    assert "max_model_len" not in line
    assert not line.endswith(("fix", "fix it"))


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--gpu-blocks", 10**9), ("--layers-per-group", 10**6), ("--requests", 10**8)],
)
def test_absurd_sizes_are_refused_before_allocating(
    capsys: pytest.CaptureFixture[str], flag: str, value: int
) -> None:
    line = _one_error_line(capsys, ["simulate", flag, str(value)])
    assert line.startswith(f"hybridkv simulate: error: {flag}={value}: the run would allocate")
    assert "of memory is free; pass " + flag in line


def _setup_for(options: SimOptions, gpu_blocks: int) -> Any:
    # the setup simulate itself derives from the options, for a model the test names
    return sim_run._setup(options, preset_config("gemma-3-1b"), gpu_blocks)


def test_the_suggested_size_fits_and_one_more_does_not() -> None:
    trace = builtin_workload("multi-turn", 4)
    options = SimOptions(preset="gemma-3-1b", host_bytes=1 << 20, gpu_blocks=10**6)
    setup = _setup_for(options, 10**6)
    available = 2 << 30
    with pytest.raises(HybridKVConfigError) as caught:
        check_run_memory(options, setup, trace, available=available)
    assert caught.value.field == "--gpu-blocks"
    fits = int(caught.value.fix.split()[2])
    check_run_memory(options, _setup_for(options, fits), trace, available=available)
    with pytest.raises(HybridKVConfigError):
        check_run_memory(options, _setup_for(options, fits + 1), trace, available=available)


def test_bad_input_through_the_process_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xff" + _deep(100_000).encode())
    for argv in (["plan", "--config", str(bad)], ["simulate", "--gpu-blocks", str(10**9)]):
        done = subprocess.run(
            [sys.executable, "-m", "hybridkv", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr
