"""The simulator behind ``hybridkv simulate``: the spec's scheduler drives the optimized connector
(or the spec's reference connector) on real tensors, and every loaded byte is checked.

It is one of the two packages that import :mod:`spec` (the other is :mod:`hybridkv.cli`, which
parses the flags, checks them and renders what this package returns). A test or a program runs
a simulation without argparse::

    from hybridkv.simulator.options import SimOptions
    from hybridkv.simulator.run import simulate

    report = simulate(SimOptions(requests=4))

Modules: :mod:`~hybridkv.simulator.options` (what a run is asked for),
:mod:`~hybridkv.simulator.run` (assemble and run one simulation),
:mod:`~hybridkv.simulator.engine` (the step loop), :mod:`~hybridkv.simulator.plane` (the
worker-side hooks the loop drives), :mod:`~hybridkv.simulator.result` (what a run ends with),
:mod:`~hybridkv.simulator.on_vllm` (the same workload through vLLM's own Scheduler), and the
parts they are built from.
"""
