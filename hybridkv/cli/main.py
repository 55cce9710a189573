"""Entry point of the ``hybridkv`` command: parses arguments and dispatches to subcommands.

Every expected failure (bad input, a missing file) ends as ONE line on stderr and exit code 2;
a traceback from ``hybridkv`` is always a bug.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from hybridkv import __version__
from hybridkv.cli.check import add_parser as add_check_parser
from hybridkv.cli.plan import add_parser as add_plan_parser
from hybridkv.cli.simulate import add_parser as add_simulate_parser
from hybridkv.errors import HybridKVConfigError
from spec.errors import ConfigError

__all__ = ["build_parser", "main"]

# The CPU build of torch warns on import when numpy is absent; hybridkv never hands torch a
# numpy array, so the warning tells a user of the command nothing.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Verified KV-cache offloading for hybrid LLMs: plan, check, simulate.",
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_plan_parser(sub)
    add_check_parser(sub)
    add_simulate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except (ConfigError, HybridKVConfigError) as err:
        print(f"hybridkv {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
