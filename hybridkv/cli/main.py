"""Entry point of the ``hybridkv`` command: parses arguments and dispatches to subcommands.

Every expected failure (bad input, a missing file) ends as ONE line on stderr and exit code 2;
a traceback from ``hybridkv`` is always a bug. An error raised below the command line names the
setting as the model spells it (``max_model_len``); the line names the flag the user typed
(``--max-model-len``) instead.

A reader that closes stdout early (``hybridkv plan --json | head -1``) is not an error of the
command: the rest of the output goes to ``/dev/null``, nothing is printed and the exit code is
1, as Python's documented recipe and rich (which draws the tables) both do.
"""

from __future__ import annotations

import argparse
import os
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
EXIT_BROKEN_PIPE = 1  # Python's recipe for a closed stdout, and rich's


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
    for command in sub.choices.values():
        command.set_defaults(flag_names=_flags_by_dest(command))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    try:
        try:
            code = _run(argv)
        finally:
            # A closed pipe shows here, not in the interpreter's exit (--help raises SystemExit
            # with its text still buffered).
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so the final flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return code


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except (ConfigError, HybridKVConfigError) as err:
        shown = _as_flags(err, args.flag_names)
        print(f"hybridkv {args.command}: error: {shown}", file=sys.stderr)
        return EXIT_USAGE
    return code


def _as_flags(
    err: ConfigError | HybridKVConfigError, flags: dict[str, str]
) -> ConfigError | HybridKVConfigError:
    """``err`` naming the command's flag (``--max-model-len``) for the model's ``max_model_len``."""
    flag = flags.get(err.field)
    return err if flag is None else type(err)(flag, err.value, err.problem, err.fix)


def _flags_by_dest(parser: argparse.ArgumentParser) -> dict[str, str]:
    """A subcommand's options by destination: ``{"max_model_len": "--max-model-len"}``."""
    # argparse lists a parser's actions only in this attribute.
    actions = parser._actions
    return {a.dest: max(a.option_strings, key=len) for a in actions if a.option_strings}


if __name__ == "__main__":
    sys.exit(main())
