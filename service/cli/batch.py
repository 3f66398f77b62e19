"""The ``splu`` command line (SPEC §5): the batch commands, which need neither Kafka nor
Faust. The ``splu`` entry point is `streams/cli.py`, which adds the stream's commands;
``python -m service.cli.batch`` runs the batch ones alone."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from service.cli.commands import audit, data, guarantees, merge, plan, publish, query
from service.cli.commands.common import CommandError, Commands
from service.core.reconstruct import QueryError
from service.core.schema import SchemaError


def new_parser() -> tuple[argparse.ArgumentParser, Commands]:
    """The ``splu`` parser without commands, and what they are added to."""
    parser = argparse.ArgumentParser(
        prog="splu",
        description=(
            "SPLU Stream: publish survey responses so that large counts stay accurate and "
            "small counts stay private. Public attributes are published as they are; "
            "sensitive ones are randomized (decoy groups or personal groups)."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, commands


def register(commands: Commands) -> None:
    """Add the batch commands, in the order ``splu --help`` lists them."""
    for group in (publish, query, guarantees, plan, merge, audit, data):
        group.register(commands)


def build_parser() -> argparse.ArgumentParser:
    parser, commands = new_parser()
    register(commands)
    return parser


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run one command of `parser` (default: the batch commands') on `argv`."""
    args = (build_parser() if parser is None else parser).parse_args(argv)
    try:
        return args.run(args)
    # ConnectionError: a broker or Redis that does not answer or refuses the stream's user.
    except (CommandError, SchemaError, QueryError, ValueError, ConnectionError) as err:
        print(f"splu {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"splu {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
