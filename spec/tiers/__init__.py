"""The remote tier of issue 12, modelled: chunks, the remote map, the two-tier store, and the
explorer adapter. One idea per module:

- :mod:`spec.tiers.chunk`: chunk keys and the codec's observable behaviour;
- :mod:`spec.tiers.remote`: the server's map, which may lose any chunk;
- :mod:`spec.tiers.two_tier`: the host store composed with the remote map (write-behind,
  lookup, promotion, faults) and its snapshot for the TT-* invariants;
- :mod:`spec.tiers.model`: the bounded exhaustive explorer's view of it.
"""
