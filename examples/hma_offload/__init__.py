"""A small KV offload connector for vLLM built from hybridkv's parts (tutorial:
docs/tutorial/build-a-connector.md).

Load it by module path::

    --kv-transfer-config '{"kv_connector": "ExampleOffloadConnector",
      "kv_connector_module_path": "examples.hma_offload", "kv_role": "kv_both",
      "kv_connector_extra_config": {"host_bytes": 1073741824}}'

- :mod:`.layout`: vLLM's KV cache groups read as hybridkv's planner and canonical specs;
- :mod:`.scheduler`: claims, loads and stores over a :class:`hybridkv.store.HostStore`
  (no vLLM);
- :mod:`.worker`: the copies, with a hybridkv transfer engine over canonical caches;
- :mod:`.connector`: the vLLM facade that hands each hook to one of the two.
"""

from typing import Any

__all__ = ["ExampleOffloadConnector"]


def __getattr__(name: str) -> Any:
    """The connector imports vLLM, so it loads on first use: the scheduler and layout modules
    import without vLLM (tests/example_connector drives the scheduler side on its own)."""
    if name == "ExampleOffloadConnector":
        from examples.hma_offload.connector import ExampleOffloadConnector

        return ExampleOffloadConnector
    raise AttributeError(f"module 'examples.hma_offload' has no attribute {name!r}")
