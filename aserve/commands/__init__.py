"""The command layer: argument parsing and config building for every subcommand.

``cli.py`` calls ``main``; each module here registers its subcommands (``register``) and turns
parsed flags into frozen configs, then calls into the packages that do the work. A new command
is a module with a ``register(subparsers)``, listed in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import sys

from aserve.commands import bench, generate, monitor, predictor, profile, replay, serve, soak

EXIT_USAGE = 2
COMMANDS = (generate, bench, profile, serve, replay, predictor, monitor, soak)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aserve", description="aserve's command line: argparse -> frozen configs -> run. "
                                "Bad input: one line, exit code 2.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a result file records as its command
    try:
        return args.func(args) or 0
    # model.loader's ModelNotFound is a FileNotFoundError, model.config's UnsupportedModel a ValueError:
    # caught here without importing model.loader, which imports torch (seconds a command like
    # ``monitor`` never needs)
    except (ValueError, FileNotFoundError) as e:
        print(f"aserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
