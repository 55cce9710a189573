"""Programs built on hybridkv's public API, the way a connector author outside hybridkv starts.

Each imports hybridkv's public names only (docs/reference/api/public-names.txt); the
``public_api`` import-linter contract (pyproject.toml) checks it.

- :mod:`examples.hma_offload`: a small host-memory offload connector for vLLM 0.33 hybrid
  attention models (``SupportsHMA``), walked through in docs/tutorial/build-a-connector.md.
"""
