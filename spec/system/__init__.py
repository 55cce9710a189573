"""The whole engine as one model: scheduler, reference connector, worker, host store and content.

:mod:`spec.system.content` (what blocks hold), :mod:`spec.system.engine` (the discrete events),
:mod:`spec.system.model` (the explorer adapter), :mod:`spec.system.scenarios` (the starts that
``hybridkv check`` explores). The TR-* and DATA-* invariants are in
:mod:`spec.invariants.system`.
"""
