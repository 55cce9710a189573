"""What unit binding costs an evicting store, beside the same store with nothing bound.

A full host store of mamba-hybrid units (one full-attention chunk and two mamba states each,
the states bound to the unit as the connector binds them) takes one more unit per call, so
every call evicts; ``unbound`` makes the same calls with nothing bound. The dead keys are
indexed (``hybridkv.store.manager``: who watches whom, the dead in the order they died), so
the bound store's cost per call should not grow with the resident chunks; a walk of the
policy's order would (the first version of the rule cost 2.6 ms per call at 3,000 chunks and
33 ms at 30,000). Both runs must evict the same number of chunks; the script checks that.

Usage: ``python tools/bench_store_binding.py [--sizes 3000,30000,300000] [--calls 2000]
[--policy lru]``.
"""

from __future__ import annotations

import argparse
import time

from hybridkv.store import HostStore, PrepareStoreOutput


def _unit(i: int) -> list[bytes]:
    return [b"full-%d" % i, b"mamba-a-%d" % i, b"mamba-b-%d" % i]


def per_call_us(size: int, calls: int, policy: str, *, bound: bool) -> tuple[float, int]:
    """Microseconds per evicting store call on a full store of ``size`` chunks, and the
    chunks those calls evicted."""
    store = HostStore(size, policy)
    i = 0
    while 3 * (i + 1) <= size:
        keys = _unit(i)
        store.prepare_store(keys, bound=keys[1:] if bound else ())
        store.complete_store(keys, success=True)
        i += 1
    evicted = 0
    start = time.perf_counter()
    for j in range(i, i + calls):
        keys = _unit(j)
        out = store.prepare_store(keys, bound=keys[1:] if bound else ())
        if not isinstance(out, PrepareStoreOutput):
            raise SystemExit(f"size {size}: a store was refused ({out})")
        evicted += len(out.evicted_keys)
        store.complete_store(out.keys_to_store, success=True)
    return (time.perf_counter() - start) / calls * 1e6, evicted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="3000,30000,300000")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru")
    args = parser.parse_args(argv)
    print(f"policy {args.policy}, {args.calls} evicting store calls of 3 chunks")
    print(f"{'chunks':>8} {'bound us/call':>14} {'unbound us/call':>16} {'ratio':>6}")
    for size in (int(s) for s in args.sizes.split(",")):
        ours, ours_evicted = per_call_us(size, args.calls, args.policy, bound=True)
        plain, plain_evicted = per_call_us(size, args.calls, args.policy, bound=False)
        if ours_evicted != plain_evicted:
            raise SystemExit(f"size {size}: evicted {ours_evicted} bound, {plain_evicted} not")
        print(f"{size:>8} {ours:>14.1f} {plain:>16.1f} {ours / plain:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
