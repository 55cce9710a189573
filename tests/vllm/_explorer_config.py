"""The configuration explorer's search space (issue 28, item 2): one :class:`Config` is a vLLM
0.33 configuration, a HybridKVConnector extra config, a fault plan, a reset schedule and a
workload seed, drawn over the axes below, each axis drawn on every configuration.

Drawn by Hypothesis (:func:`configs`, which shrinks a failure towards each axis's first choice)
or by a seed (:func:`config_from_seed`, the soak's 10,000): both run one function,
:func:`build`, over a ``pick(axis, choices)``, so the two draw the same space. A configuration
replays from one line of JSON (:attr:`Config.replay`, :meth:`Config.from_json`).

The axes, and what is left out and why:

- ``layout``: sliding window + full, two windows + full, mamba (gated delta net, align) + full
  (:data:`diffharness.layouts.RECIPES`), and Nemotron-H ``M*M*`` (Mamba-2 with prefill
  checkpoints, block 1,152: the mamba-key-after-preemption path of issue 28). Left out: a mamba
  block unequal to the attention block. With prefix caching on, vLLM 0.33 runs mamba in
  ``align`` mode with ``mamba_block_size = block_size`` (``spec/layout.py``), so no layout
  with a host tier has one; only the hash block differs (``prefix_match_unit`` below).
- ``async_scheduling``: vLLM's batch-queue loop or the synchronous one (the explorer draws the
  loop itself, whatever ``HYBRIDKV_ENGINE_LOOP`` says).
- ``speculative``: none, MTP (the mamba layouts only: gpt-oss has no MTP head and vLLM refuses
  ``method="mtp"`` there), EAGLE and EAGLE-3 (a one-layer Llama draft config written beside
  the model: vLLM refuses a draft built from the target's own config, ``EagleGptOss...`` is no
  architecture it knows), ngram (synchronous loop only: vLLM refuses ngram under async
  scheduling, ``VllmConfig`` validation); 1-4 speculative tokens; the runner's speculative hook
  order on or off. No draft model runs (the stand-in runner).
- ``max_num_batched_tokens``: one block up to 8,192 tokens, bounded by ``max_model_len``
  (chunked prefill is always on); ``max_num_seqs`` 1-4.
- ``prefix_match_unit``: none or a divisor of the block (partial hash hits,
  ``cache_hit_alignment_tokens``) on the windowed layouts; vLLM refuses one that does not
  divide every group's block. Not on the mamba layouts: there the stand-in runner reads wrong
  mamba states on vLLM's own mid-block GPU hits, with no connector (a harness limitation).
- ``hash_algo``: sha256, sha256_cbor, xxhash, xxhash_cbor. ``PYTHONHASHSEED`` only matters with
  a shared tier, which is out of scope here (two engines and a Redis server: ``nox -s remote``
  and the soak's ``remote`` family cover it).
- ``offload_decode_state`` on/off; ``chunk_size`` the default or 1, 2 or 4 claim units;
  ``eviction_policy`` lru/arc; the host tier from a quarter to four times the workload's working
  set (its distinct block-aligned prefixes, one slot per block and group: approximate).
- ``kv_load_failure_policy`` recompute or fail (a failed load then ends its request with an
  error: finished, not recomputed); load and store failure rates (:class:`FaultPlan`), copies
  0-3 steps late, ``load_deadline_steps`` none/1/2 (recompute only: hybridkv refuses a deadline
  under ``fail``, by design, so that pair is not drawn).
- the GPU pool: vLLM's smallest for the loop in use plus 0-16 blocks (preemption pressure);
  or (``pool_fit``, issue 29) a pool that holds one, two or three whole requests of a workload
  whose 4-7 requests share one long prefix (:func:`_random_traces.shared_prefix_trace`; the pool
  is never below vLLM's smallest): the later requests find the prefix on the host and claim it
  as async loads that may fill the pool. ``pool_extra`` is then not drawn.
- aborts: of requests waiting for their load, of requests with a store in flight, at random.
- events between steps: ``reset_prefix_cache`` (vLLM's cache; and with the connector),
  ``reset_running_requests`` (under async scheduling after a ``pause(mode="keep")`` until the
  steps in the batch queue land, as vLLM needs), ``pause_generation(clear_cache=True)`` as the
  in-process engine core runs it (vLLM raises while a load is in flight: counted as refused)
  and as a server runs it (aborts, waits for the engine to go idle, then clears), sleep levels
  1 and 2 then ``wake_up``.
- tensor parallel 1 or 2 ranks, the KV replicated or sharded (simulated in one process).
- the workload: 4-7 requests over two shared prompt bases (:func:`_random_traces.random_trace`),
  or the long shared prefix above under ``pool_fit``, from ``seed``.

Out of scope: the shared tier (two engines and Redis).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from hypothesis import strategies as st

__all__ = [
    "AXES",
    "EVENTS",
    "LAYOUTS",
    "POOL_FITS",
    "Config",
    "Geometry",
    "axis_values",
    "build",
    "config_from_seed",
    "configs",
]

T = TypeVar("T")
Pick = Callable[[str, Sequence[Any]], Any]

POOL_FITS = (None, None, 1, 2, 3)
"""``pool_fit``'s choices: the long-shared-prefix workload on a pool of 1-3 whole requests in
three configurations of five (None, listed twice, keeps the varied workload in the rest)."""

EVENTS = (
    "reset_cache",
    "reset_connector",
    "reset_running",
    "pause_inproc",
    "pause_server",
    "sleep1",
    "sleep2",
)
"""What may happen between two steps (module docstring)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the explorer needs of a layout: its block (the claim unit), ``max_model_len``, the
    longest prompt and output of its workload, and whether it has an MTP head."""

    name: str
    block: int
    max_model_len: int
    max_prompt: int
    max_tokens: int
    mtp: bool


LAYOUTS = {
    g.name: g
    for g in (
        Geometry("sliding+full", 32, 512, 400, 40, mtp=False),
        Geometry("2sliding+full", 32, 512, 400, 24, mtp=False),
        Geometry("mamba+full", 640, 2560, 2400, 3, mtp=True),
        Geometry("mamba2+full", 1152, 4608, 3600, 12, mtp=True),
    )
}
"""The layouts, simplest first (a failure shrinks towards sliding + full)."""


@dataclass(frozen=True, slots=True)
class Config:
    """One drawn configuration; every field is one axis's value (module docstring).

    ``events`` are ``(step, kind)`` pairs, ``kind`` one of :data:`EVENTS`; ``host_ratio`` scales
    the workload's working set; ``pool_extra`` is added to vLLM's smallest pool; ``pool_fit``
    (None: not drawn) sizes the pool to that many whole requests of a long-shared-prefix
    workload instead.
    """

    layout: str = "sliding+full"
    async_scheduling: bool = False
    speculative: str = "none"
    num_speculative_tokens: int = 1
    speculative_hooks: bool = False
    max_num_batched_tokens: int = 32
    max_num_seqs: int = 1
    prefix_match_unit: int | None = None
    hash_algo: str = "sha256"
    offload_decode_state: bool = True
    chunk_units: int | None = None
    eviction_policy: str = "lru"
    host_ratio: float = 4.0
    failure_policy: str = "recompute"
    load_rate: float = 0.0
    store_rate: float = 0.0
    delay: int = 0
    deadline: int | None = None
    pool_extra: int = 16
    pool_fit: int | None = None
    abort_loading: float = 0.0
    abort_storing: float = 0.0
    abort_random: float = 0.0
    events: tuple[tuple[int, str], ...] = ()
    tensor_parallel: int = 1
    replicated_kv: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"Config.layout={self.layout!r}: use one of {sorted(LAYOUTS)}")
        for _step, kind in self.events:
            if kind not in EVENTS:
                raise ValueError(f"Config.events: {kind!r} is no event; use one of {EVENTS}")

    @property
    def geometry(self) -> Geometry:
        return LAYOUTS[self.layout]

    def to_json(self) -> str:
        """One line of JSON holding every field (what :meth:`from_json` reads back)."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Config:
        """The configuration :meth:`to_json` wrote; a missing field takes its default."""
        values = json.loads(text)
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"Config: unknown fields {sorted(unknown)}; drop them")
        if "events" in values:
            values["events"] = tuple((int(s), str(k)) for s, k in values["events"])
        return cls(**values)

    @property
    def replay(self) -> str:
        """The one command that replays this configuration."""
        return f"python tools/explore.py --replay '{self.to_json()}'"


def _budgets(g: Geometry) -> tuple[int, ...]:
    """One block up to 8k tokens, bounded by ``max_model_len``: the smallest first."""
    top = min(8192, g.max_model_len)
    steps = sorted({g.block, 2 * g.block, 4 * g.block, top, (g.block + top) // 2})
    return tuple(b for b in steps if g.block <= b <= top)


def _hash_units(g: Geometry) -> tuple[int | None, ...]:
    if g.mtp:
        # The mamba layouts: with a prefix_match_unit below the block the stand-in runner reads
        # wrong mamba states on vLLM's own mid-block GPU prefix hits with no connector at all
        # (Qwen3-Next and Nemotron-H, every unit tried): it does not follow the GPU runner's
        # mamba state there. A harness limitation, so not drawn.
        return (None,)
    return (None, *(u for u in (8, 16, 128, 320, 384) if u < g.block and g.block % u == 0))


def _speculative(g: Geometry, async_scheduling: bool) -> tuple[str, ...]:
    methods = ["none", "eagle", "eagle3"]
    if g.mtp:
        methods.insert(1, "mtp")
    if not async_scheduling:
        methods.append("ngram")  # vLLM refuses ngram under async scheduling
    return tuple(methods)


def _chunk_units(g: Geometry) -> tuple[int | None, ...]:
    return (None, *(n for n in (1, 2, 4) if n * g.block < g.max_model_len))


def build(pick: Pick) -> Config:
    """Draw every axis through ``pick(axis, choices)`` (first choice: the simplest)."""
    layout = pick("layout", tuple(LAYOUTS))
    g = LAYOUTS[layout]
    async_scheduling = pick("async_scheduling", (False, True))
    speculative = pick("speculative", _speculative(g, async_scheduling))
    failure_policy = pick("failure_policy", ("recompute", "fail"))
    tensor_parallel = pick("tensor_parallel", (1, 2))
    pool_fit = pick("pool_fit", POOL_FITS)
    n_events = pick("n_events", (0, 1, 2))
    events = tuple(
        (pick("event_step", tuple(range(1, 40))), pick("event", EVENTS)) for _ in range(n_events)
    )
    return Config(
        layout=layout,
        async_scheduling=async_scheduling,
        speculative=speculative,
        num_speculative_tokens=pick("num_speculative_tokens", (1, 2, 3, 4)),
        speculative_hooks=speculative in ("mtp", "eagle", "eagle3")
        and pick("speculative_hooks", (False, True)),
        max_num_batched_tokens=pick("max_num_batched_tokens", _budgets(g)),
        max_num_seqs=pick("max_num_seqs", (1, 2, 3, 4)),
        prefix_match_unit=pick("prefix_match_unit", _hash_units(g)),
        hash_algo=pick("hash_algo", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
        offload_decode_state=pick("offload_decode_state", (True, False)),
        chunk_units=pick("chunk_units", _chunk_units(g)),
        eviction_policy=pick("eviction_policy", ("lru", "arc")),
        host_ratio=pick("host_ratio", (4.0, 2.0, 1.0, 0.5, 0.25)),
        failure_policy=failure_policy,
        load_rate=pick("load_rate", (0.0, 0.3, 0.6, 1.0)),
        store_rate=pick("store_rate", (0.0, 0.3, 0.6)),
        delay=pick("delay", (0, 1, 2, 3)),
        deadline=pick("deadline", (None, 1, 2)) if failure_policy == "recompute" else None,
        pool_extra=0 if pool_fit else pick("pool_extra", (16, 8, 4, 2, 1, 0)),
        pool_fit=pool_fit,
        abort_loading=pick("abort_loading", (0.0, 0.25)),
        abort_storing=pick("abort_storing", (0.0, 0.05)),
        abort_random=pick("abort_random", (0.0, 0.01, 0.03)),
        events=events,
        tensor_parallel=tensor_parallel,
        replicated_kv=tensor_parallel > 1 and pick("replicated_kv", (False, True)),
        seed=pick("seed", range(1 << 16)),
    )


@st.composite
def configs(draw: Callable[..., Any]) -> Config:
    """Hypothesis's strategy over :func:`build`'s axes."""
    return build(lambda axis, choices: draw(st.sampled_from(choices), label=axis))


def config_from_seed(seed: int) -> Config:
    """The configuration a seed draws (the soak's: the same axes as :func:`configs`)."""
    import random

    rng = random.Random(seed)
    return build(lambda axis, choices: rng.choice(choices))


def _budget_label(c: Config) -> str:
    budgets = _budgets(c.geometry)
    if c.max_num_batched_tokens == budgets[0]:
        return "one-block"
    return "max" if c.max_num_batched_tokens == budgets[-1] else "between"


def axis_values(c: Config) -> dict[str, str]:
    """Each axis's value as a label (what the coverage counts per axis)."""
    tp = "1" if c.tensor_parallel == 1 else f"2-{'replicated' if c.replicated_kv else 'sharded'}"
    found = {
        "layout": c.layout,
        "async_scheduling": str(c.async_scheduling),
        "speculative": c.speculative,
        "num_speculative_tokens": str(c.num_speculative_tokens if c.speculative != "none" else 0),
        "speculative_hooks": str(c.speculative_hooks),
        "max_num_batched_tokens": _budget_label(c),
        "max_num_seqs": str(c.max_num_seqs),
        "prefix_match_unit": "none" if c.prefix_match_unit is None else "partial",
        "hash_algo": c.hash_algo,
        "offload_decode_state": str(c.offload_decode_state),
        "chunk_size": "default" if c.chunk_units is None else f"{c.chunk_units}-units",
        "eviction_policy": c.eviction_policy,
        "host_ratio": str(c.host_ratio),
        "failure_policy": c.failure_policy,
        "load_rate": str(c.load_rate),
        "store_rate": str(c.store_rate),
        "delay": str(c.delay),
        "deadline": str(c.deadline),
        "pool_fit": "none" if c.pool_fit is None else str(c.pool_fit),
        "abort_loading": str(c.abort_loading),
        "abort_storing": str(c.abort_storing),
        "abort_random": str(c.abort_random),
        "tensor_parallel": tp,
    }
    if c.pool_fit is None:
        found["pool_extra"] = str(c.pool_extra)  # not drawn under pool_fit
    for _step, kind in c.events:
        found[f"event:{kind}"] = "drawn"
    return found


AXES: dict[str, tuple[str, ...]] = {
    "layout": tuple(LAYOUTS),
    "async_scheduling": ("False", "True"),
    "speculative": ("none", "mtp", "eagle", "eagle3", "ngram"),
    "num_speculative_tokens": ("0", "1", "2", "3", "4"),
    "speculative_hooks": ("False", "True"),
    "max_num_batched_tokens": ("one-block", "between", "max"),
    "max_num_seqs": ("1", "2", "3", "4"),
    "prefix_match_unit": ("none", "partial"),
    "hash_algo": ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
    "offload_decode_state": ("True", "False"),
    "chunk_size": ("default", "1-units", "2-units", "4-units"),
    "eviction_policy": ("lru", "arc"),
    "host_ratio": ("4.0", "2.0", "1.0", "0.5", "0.25"),
    "failure_policy": ("recompute", "fail"),
    "load_rate": ("0.0", "0.3", "0.6", "1.0"),
    "store_rate": ("0.0", "0.3", "0.6"),
    "delay": ("0", "1", "2", "3"),
    "deadline": ("None", "1", "2"),
    "pool_extra": ("16", "8", "4", "2", "1", "0"),
    "pool_fit": ("none", "1", "2", "3"),
    "abort_loading": ("0.0", "0.25"),
    "abort_storing": ("0.0", "0.05"),
    "abort_random": ("0.0", "0.01", "0.03"),
    "tensor_parallel": ("1", "2-sharded", "2-replicated"),
    **{f"event:{kind}": ("drawn",) for kind in EVENTS},
}
"""Every value each axis can take (as :func:`axis_values` labels it): a run of the explorer
must play each at least once."""
