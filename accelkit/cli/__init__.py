"""The ``accelkit`` command. Each subcommand lives in its own module of this package with
``add_parser(subparsers)`` and ``run(args) -> int``; modules load only when their command runs."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("accelkit.cli.env", "versions, devices and every backend with its status"),
    "run": ("accelkit.cli.run", "launch a script on several processes or machines (torchrun)"),
    "demo": ("accelkit.cli.demo", "train a small model, save, resume, and print a summary"),
    "convert": ("accelkit.cli.convert", "convert checkpoints to and from the portable format"),
    "inspect": ("accelkit.cli.inspect", "print a checkpoint's manifest and verify its checksums"),
    "bench": ("accelkit.cli.bench", "compare backends on one model: step time, throughput, memory"),
    "plan": ("accelkit.cli.plan", "estimate per-device memory of each backend for a model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelkit", description="One training loop, any backend.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # command not built yet
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_parser(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from accelkit import __version__

        print(__version__)
        return 0
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
