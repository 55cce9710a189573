"""``hybridkv simulate --engine vllm``: the same workload driven by vLLM 0.33's real ``Scheduler``.

vLLM's scheduler admits, preempts and finishes the requests; ``HybridKVConnector`` runs both
roles, its worker side in-process on CPU tensors in the model runner's hook order, and the
stand-in forward checks every KV slot and mamba state it reads
(:mod:`hybridkv.vllm.harness.inprocess`, :mod:`hybridkv.vllm.harness.workload`). vLLM is imported
only here, lazily, and only for this engine; without it the run stops with one line naming
``nox -s vllm`` and the install command.

The model: vLLM on CPU allocates every layer's cache for real, so a preset becomes its
:func:`spec.presets.tiny_config` (one period of its layer pattern per simulated layer per group:
the same groups, block sizes and pages, fewer layers), and a multimodal config its text model
(vLLM builds no vision processor without a tokenizer); the report's header says so. The GPU pool
defaults to three of the trace's longest sequences, as the spec engine's, so prefixes are evicted
and loaded back (:data:`DEFAULT_REQUESTS` for the workload), in the geometry
:func:`spec.layout.derive_layout` derives for vLLM's CPU platform (``nox -s vllm`` checks the two
agree).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import time
from collections.abc import Mapping
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.simulator.model_config import load_model_config
from hybridkv.simulator.options import SimOptions
from hybridkv.simulator.recovery import RecoveryWatch
from hybridkv.simulator.setup import SimSetup, derive_setup
from hybridkv.simulator.threads import one_intra_op_thread
from hybridkv.testbed.copy_time import DEFAULT_GBPS, DEFAULT_LATENCY_US, DEFAULT_STEP_MS

__all__ = [
    "DEFAULT_REQUESTS",
    "VLLM_INSTALL",
    "check_vllm_flags",
    "require_vllm",
    "simulate_vllm",
    "vllm_model",
]

VLLM_INSTALL = (
    "pip install -r tests/vllm/requirements-vllm.txt && "
    "pip install --no-deps vllm==0.33.0 xgrammar==0.2.8"
)
DEFAULT_REQUESTS = 48
"""A built-in workload's requests when ``--requests`` is not given: 12 conversations of the
multi-turn trace (the spec engine serves 32). In a pool of three longest sequences they push
each other's prefixes out, so most of a returning turn is loaded from the host tier; and they
issue about 190 transfer jobs, so ``--faults 0.1`` fails about 19 (32 requests issue about 125
and fail 8 with seed 0). On 2 cores the engine steps take 12 to 30 s, by the machine's load."""
PLATFORM = "cpu"  # vLLM's CpuPlatform: the geometry the in-process engine gets


def require_vllm() -> None:
    """Refuse, in one line, a Python without vLLM 0.33 (or whose torchvision cannot import).

    Refusal: :class:`HybridKVConfigError` (field ``--engine``) naming ``nox -s vllm`` and the
    install command. Frame: nothing changes.
    """
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as err:
        raise HybridKVConfigError(
            "--engine",
            "vllm",
            f"vLLM 0.33 is not installed in this Python ({err})",
            f"run `nox -s vllm`, or install it: {VLLM_INSTALL}",
        ) from None
    version = str(getattr(vllm, "__version__", ""))
    if not version.startswith("0.33"):
        raise HybridKVConfigError(
            "--engine",
            "vllm",
            f"needs vLLM 0.33, this Python has {version or 'an unknown version'}",
            f"run `nox -s vllm`, or install it: {VLLM_INSTALL}",
        )
    if importlib.util.find_spec("torchvision") is not None:
        try:
            importlib.import_module("torchvision")
        except (ImportError, RuntimeError) as err:
            raise HybridKVConfigError(
                "--engine",
                "vllm",
                f"torchvision, which vLLM's Qwen3.5 module imports, fails to import ({err})",
                "install the torchvision build of your torch; with CPU torch beside the CUDA "
                "wheel put tests/vllm/_torchvision_shim on PYTHONPATH, as nox -s vllm does",
            ) from None


_UNSUPPORTED = (
    # (option, its default, why vLLM's engine cannot honour another value)
    ("connector", "optimized", "--connector", "HybridKVConnector runs the optimized core"),
    ("device", "cpu", "--device", "the in-process engine keeps the KV on CPU tensors"),
    ("check", False, "--check", "the spec's invariants run on vLLM's state in nox -s vllm"),
    ("aborts", 0.0, "--aborts", "client aborts are exercised by nox -s vllm's random traces"),
    ("transfer_gbps", DEFAULT_GBPS, "--transfer-gbps", "copies report after one poll"),
    ("transfer_latency_us", DEFAULT_LATENCY_US, "--transfer-latency-us", "no copy-time model"),
    ("step_ms", DEFAULT_STEP_MS, "--step-ms", "no copy-time model"),
)


def check_vllm_flags(options: SimOptions, plot: str | None) -> None:
    """Refuse flags the vLLM engine cannot honour (one line naming the flag and the fix)."""
    for name, default, flag, why in _UNSUPPORTED:
        value = getattr(options, name)
        if value != default:
            raise HybridKVConfigError(
                flag, value, f"is not available with --engine vllm ({why})", f"drop {flag}"
            )
    if plot:
        raise HybridKVConfigError(
            "--plot", plot, "is not available with --engine vllm (no timeline)", "drop --plot"
        )
    if not 0.0 <= options.faults <= 1.0:
        raise HybridKVConfigError(
            "--faults", options.faults, "is not a probability", "pass a value in [0, 1]"
        )


def vllm_model(
    preset: str | None, config: str | None, layers_per_group: int
) -> tuple[str, dict[str, Any], str]:
    """``(source, config.json dict vLLM builds, what was changed)`` for the vLLM engine.

    A preset (the default preset when neither is given) is cut to ``layers_per_group`` periods
    of its layer pattern; a ``--config`` file is used as given. A config with a ``text_config``
    becomes its text model (``...ForConditionalGeneration`` -> ``...ForCausalLM``).
    """
    from spec.presets import DEFAULT_PRESET, PRESETS, tiny_config

    source, loaded = load_model_config(preset, config)
    notes = []
    cfg = dict(loaded)
    if config is None:
        name = preset or DEFAULT_PRESET
        period = tiny_config(name).get("text_config", tiny_config(name))["num_hidden_layers"]
        full = PRESETS[name].config.get("text_config", PRESETS[name].config)["num_hidden_layers"]
        layers = min(full, period * layers_per_group)
        cfg = tiny_config(name, layers)
        notes.append(f"{layers} of its {full} layers (same groups, blocks and pages)")
    if isinstance(cfg.get("text_config"), Mapping):
        text = dict(cfg["text_config"])
        text["architectures"] = [
            a.replace("ForConditionalGeneration", "ForCausalLM")
            for a in cfg.get("architectures", [])
        ]
        cfg = text
        notes.append("its text model")
    return source, cfg, ", ".join(notes) or "as given"


def _setup(options: SimOptions, cfg: Mapping[str, Any], max_model_len: int) -> SimSetup:
    return derive_setup(
        cfg,
        max_model_len=max_model_len,
        gpu_blocks=options.gpu_blocks or 1,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_num_running=options.max_num_running,
        layers_per_group=1,
        load_deadline_steps=None,
        platform=PLATFORM,
    )


def _recovery(watch: RecoveryWatch, observed: Mapping[str, Any]) -> dict[str, int]:
    """What ``watch`` saw recover, as the spec engine counts it: wrong reads per request, and
    vLLM's aborted and errored requests as ended by design."""
    wrong, ended = observed["wrong_reads_by_request"], observed["ended_requests"]
    outcome = watch.outcome(lambda rid: wrong.get(rid, 0), lambda rid: rid in ended)
    return {
        "watched_failed_loads": outcome.failed_loads,
        "watched_failed_stores": outcome.failed_stores,
        "recovered_loads": outcome.recovered_loads,
        "recovered_stores": outcome.recovered_stores,
        "failures_ended": outcome.ended,
    }


@one_intra_op_thread  # as the spec engine: the forward's tensor ops, not thread barriers
def simulate_vllm(options: SimOptions, plot: str | None = None) -> dict[str, Any]:
    """Run ``options`` through vLLM's Scheduler and return the report (same schema as the
    spec engine's where a figure is observable; ``None`` where it is not).

    Refusal: :class:`HybridKVConfigError` for flags the engine cannot honour, a Python without
    vLLM 0.33, or a GPU pool too small for the trace, before anything is allocated.
    """
    from hybridkv.simulator.limits import (
        check_arrivals,
        check_flags,
        check_run_memory,
        check_trace_memory,
    )
    from hybridkv.simulator.run import _blocks_for, _longest_sequence, _trace

    if options.requests is None and not options.trace.endswith(".jsonl"):
        options = dataclasses.replace(options, requests=DEFAULT_REQUESTS)
    check_flags(options)
    check_vllm_flags(options, plot)
    source, cfg, changed = vllm_model(options.preset, options.config, options.layers_per_group)
    check_trace_memory(options)
    trace = _trace(options)
    max_ticks = check_arrivals(trace)  # MAX_STEPS after the last arrival
    longest = _longest_sequence(trace)
    if longest > options.max_model_len:
        raise HybridKVConfigError(
            "--max-model-len",
            options.max_model_len,
            f"is shorter than the trace's longest sequence ({longest} tokens)",
            f"pass --max-model-len {longest}",
        )
    needed = _blocks_for(_setup(options, cfg, longest), longest)
    gpu_blocks = options.gpu_blocks or 3 * needed
    if gpu_blocks < needed + 1:
        # vLLM's pool keeps block 0 as its null block: ``needed`` blocks leave it short, and
        # vLLM refuses the max-model-len with a traceback instead of this line.
        raise HybridKVConfigError(
            "--gpu-blocks",
            gpu_blocks,
            f"cannot hold the trace's longest sequence ({longest} tokens needs {needed} blocks "
            "besides vLLM's null block)",
            f"pass --gpu-blocks {needed + 1} or more",
        )
    options = dataclasses.replace(options, gpu_blocks=gpu_blocks)
    setup = _setup(options, cfg, longest)
    # The CPU caches vLLM allocates (pages x blocks x layers per group) and the host tier.
    check_run_memory(options, setup, trace)
    require_vllm()
    # By name: mypy does not follow into hybridkv.vllm (excluded: it subclasses vLLM's classes).
    workload = importlib.import_module("hybridkv.vllm.harness.workload")
    start = time.perf_counter()
    engine = workload.WorkloadEngine(
        num_gpu_blocks=gpu_blocks,
        max_model_len=longest,
        max_num_seqs=options.max_num_running,
        max_num_batched_tokens=options.max_num_batched_tokens,
        host_bytes=options.host_bytes,
        policy=options.policy,
        fault_rate=options.faults,
        seed=options.seed,
    ).build(cfg)
    built = time.perf_counter()
    watch = RecoveryWatch()
    run = workload.play_workload(engine, trace, max_ticks=max_ticks, watch=watch)
    from hybridkv.simulator.vllm_report import build_report

    observed = workload.end_state(engine)
    observed = {**observed, **_recovery(watch, observed)}
    return build_report(
        options,
        {
            "model": source,
            "model_changed": changed,
            "groups": list(setup.group_kinds),
            "gpu_blocks": gpu_blocks,
            "max_model_len": longest,
            "build_seconds": round(built - start, 3),
        },
        run,
        observed,
        time.perf_counter() - built,
    )
