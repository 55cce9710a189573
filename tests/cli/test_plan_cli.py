"""`hybridkv plan` end to end: every preset, JSON schema, config files and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli.main import main
from spec.kinds import GroupKind
from spec.planner import make_planner
from spec.presets import DEFAULT_PRESET, PRESETS, tiny_config

TOP_KEYS = {
    "schema_version",
    "model",
    "settings",
    "platform",
    "groups",
    "block_size",
    "mamba_block_size",
    "scheduler_block_size",
    "hash_block_size",
    "cache_hit_alignment_tokens",
    "offload",
    "chunk_options",
    "warnings",
    "notes",
}


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_list_presets_names_at_least_six_with_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list-presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["presets"]
    assert {row["name"] for row in listed} == set(PRESETS)
    assert len(listed) >= 6
    assert all(row["source"].startswith("https://") for row in listed)
    assert main(["plan", "--list-presets"]) == 0
    assert DEFAULT_PRESET in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_plans_to_a_consistent_schema(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    plan = _run_json(capsys, "--preset", name)
    assert set(plan) == TOP_KEYS
    assert plan["schema_version"] == 1
    assert plan["platform"]["name"] == "cuda-sm90"  # the documented default is stated
    offload = plan["offload"]
    assert offload is not None, plan["warnings"]
    # The plan's offload numbers equal the formal model's planner on the same geometry.
    groups = [(GroupKind(g["kind"]), g["block_size"]) for g in plan["groups"]]
    oracle = make_planner(
        groups, plan["hash_block_size"], offload["chunk_size"], plan["settings"]["max_model_len"]
    )
    assert offload["units"] == list(oracle.units)
    assert offload["claim_unit"] == oracle.claim_unit
    assert offload["shortest_hit_prompt"] == oracle.shortest_hit_prompt
    assert plan["scheduler_block_size"] % plan["hash_block_size"] == 0
    chosen = [o for o in plan["chunk_options"] if o["chunk_size"] == offload["chunk_size"]]
    assert len(chosen) == 1


def test_text_output_names_the_assumed_platform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "gpt-oss-20b", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "platform assumed: cpu" in out
    assert "claim-alignment unit" in out


def test_user_chunk_size_is_used_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    # gpt-oss-20b: full + sliding groups, 16-token blocks, hash block 16. A 64-token chunk does
    # not divide a 16-token block, so each group keeps 16-token units and the claim unit is
    # lcm(64, 16, 16) = 64.
    plan = _run_json(capsys, "--preset", "gpt-oss-20b", "--chunk-size", "64")
    assert plan["offload"]["chunk_size_source"] == "user"
    assert plan["offload"]["units"] == [16, 16]
    assert plan["offload"]["claim_unit"] == 64
    assert plan["offload"]["shortest_hit_prompt"] == 65


def test_cache_mode_none_on_a_mamba_model_warns_and_has_no_offload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = _run_json(capsys, "--preset", "nemotron-h-8b", "--cache-mode", "none")
    assert plan["offload"] is None
    assert plan["chunk_options"] == []
    assert any("prefix caching is off" in w for w in plan["warnings"])
    assert any("offload impossible" in w for w in plan["warnings"])


def test_config_file_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config("qwen3-next-80b-a3b")), encoding="utf-8")
    by_file = _run_json(capsys, "--config", str(cfg), "--max-model-len", "32768")
    by_dir = _run_json(capsys, "--config", str(tmp_path), "--max-model-len", "32768")
    assert by_file["groups"] == by_dir["groups"]
    assert {g["kind"] for g in by_file["groups"]} == {"mamba", "full"}


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_missing_config_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", "missing.json"]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "--config" in lines[0]
    assert "missing.json" in lines[0]


def test_config_missing_a_field_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config("gpt-oss-20b")
    del cfg["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert main(["plan", "--config", str(tmp_path)]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "num_key_value_heads" in lines[0]


@pytest.mark.parametrize("offset", ["", [], "2", "period", -1, True])
def test_a_jamba_attention_offset_that_is_not_a_layer_index_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offset: object
) -> None:
    cfg = tiny_config("jamba-mini-1.5")
    # Offsets 0 .. period - 1 name a layer of each period; the period itself does not.
    cfg["attn_layer_offset"] = cfg["attn_layer_period"] if offset == "period" else offset
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert main(["plan", "--config", str(tmp_path)]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "attn_layer_offset" in lines[0]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--chunk-size", "24"], "--chunk-size=24"),
        (["--chunk-size", "0"], "--chunk-size=0"),
        (["--tp", "0"], "--tp=0"),
        (["--max-model-len", "0"], "--max-model-len=0"),
        (["--block-size", "20"], "--block-size=20"),
        (["--dtype", "int3"], "--dtype='int3'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], argv: list[str], field: str
) -> None:
    assert main(["plan", "--preset", "gpt-oss-20b", *argv]) == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert lines[0].startswith(f"hybridkv plan: error: {field}:"), lines[0]
    assert "max_model_len" not in lines[0]  # the flag's name, never the model's


def test_cpu_block_size_off_the_kernel_block_plans_with_vllms_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM on CPU keeps --block-size 16 with a warning; gpt-oss's blocks end at 32."""
    plan = _run_json(capsys, "--preset", "gpt-oss-20b", "--platform", "cpu", "--block-size", "16")
    assert plan["settings"]["block_size"] == 16
    assert [g["block_size"] for g in plan["groups"]] == [32, 32]
    assert plan["block_size"] == 32
    assert any("--block-size 16 is not a multiple of 32" in w for w in plan["warnings"])
    assert main(["plan", "--preset", "gpt-oss-20b", "--platform", "cpu", "--block-size", "16"]) == 0
    assert "--block-size 16 is not a multiple of 32" in capsys.readouterr().out
    # The same block size on the H100 platform stays refused: its kernels need multiples of 16.
    assert main(["plan", "--preset", "gpt-oss-20b", "--block-size", "8"]) == 2


def test_falcon_h1_config_file_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("falcon-h1-7b")), "utf-8")
    plan = _run_json(capsys, "--config", str(tmp_path))
    assert plan["model"]["architecture"] == "FalconH1ForCausalLM"
    assert [(g["kind"], g["num_layers"]) for g in plan["groups"]] == [("full", 2), ("mamba", 2)]
    assert plan["block_size"] == 1568
    assert plan["offload"] is not None, plan["warnings"]


def test_not_json_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json", encoding="utf-8")
    assert main(["plan", "--config", str(bad)]) == 2
    assert "is not JSON" in _stderr_lines(capsys)[0]


def test_module_entry_point_runs_the_default_preset() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridkv", "plan", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"]["source"] == f"preset:{DEFAULT_PRESET}"


def test_heads_that_do_not_divide_hidden_size_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by the fuzz: granite derives head_dim = hidden_size // num_attention_heads, and a
    # head count above hidden_size made it 0 and crashed with ZeroDivisionError.
    cfg = tiny_config("granite-4.0-h-tiny")
    cfg.pop("head_dim", None)
    cfg["num_attention_heads"] = cfg["hidden_size"] + 1
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert main(["plan", "--config", str(tmp_path)]) == 2
    assert "num_attention_heads" in _stderr_lines(capsys)[0]
