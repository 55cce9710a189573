"""The ``hybridkv`` command line: the one layer that wires the formal model and the library."""
