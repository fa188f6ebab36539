"""The `raywds` command: its parser, made from each command's options (raywds.cli.options, through
raywds.cli.flags); the one place where the parsed flags become each command's typed options; and the
one place where a RaywdsError becomes exit code 1 and a one-line message. What each command does
with its options is in raywds.cli.commands.

    raywds --help
    raywds train --demo
    python -m raywds train --demo            # the same; torchrun -m raywds train ... runs DDP ranks
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
import traceback
from typing import Any

from raywds import console
from raywds.cli.commands import COMMANDS
from raywds.cli.flags import Parser, add_flags, values
from raywds.cli.options import COMMAND_FLAGS, MainOptions, check_together
from raywds.errors import RaywdsError, one_line


@functools.cache  # built once a process: parsing leaves it as it was
def build_parser() -> argparse.ArgumentParser:
    """Every command's flags, each made from a documented dataclass field (raywds.cli.options)."""
    parser = Parser(
        prog="raywds", description="Train image classifiers from WebDataset shards, on one machine or a Ray cluster."
    )
    add_flags(parser, MainOptions)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (summary, parts) in COMMAND_FLAGS.items():
        command = sub.add_parser(name, help=summary)
        for part in parts:
            add_flags(command, part.cls, **part.keywords())
    return parser


def command_options(args: argparse.Namespace) -> list[Any]:
    """The options the parsed command takes, made here once: one typed object per group of its
    flags (raywds.cli.options.COMMAND_FLAGS), in that order (`cmd_ray(source, training, ray)`); each
    value checked as its field declares, and what they decide together, before any command starts."""
    _, parts = COMMAND_FLAGS[args.command]
    options = [part.build(values(args, part.cls, skip=part.skip, only=part.only)) for part in parts]
    check_together(options)
    return options


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT, where no run takes it as a notice: the command stops where it is, as on
    Ctrl-C (the `with` blocks unwind: a shard server started here is stopped too)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


SAME_DELIVERY_S = 1.0
"""A signal this soon after the first is the same delivery, as raywds.train.notice takes it:
`timeout` signals its command, then the command's process group."""

_stopping = [0.0]
"""When the first signal came (time.monotonic), 0 before one."""
_signalled = [0]
"""Which signal came first (0 before one): a library that catches the KeyboardInterrupt raised for
it and raises its own (Ray Train's fit) loses the number."""


def _stop(signum: int, frame: Any) -> None:
    now = time.monotonic()
    if _stopping[0] and now - _stopping[0] < SAME_DELIVERY_S:
        return
    _stopping[0] = _stopping[0] or now
    _signalled[0] = _signalled[0] or signum
    raise Stopped(signum)


def _stopped(command: str, e: KeyboardInterrupt) -> int:
    """Ctrl-C or SIGTERM: one line (with what the command added: what it keeps), 128 + the signal's number."""
    signum = getattr(e, "signum", None) or _signalled[0] or signal.SIGINT
    said = "; ".join(getattr(e, "__notes__", []))
    said_error(f"{command} stopped on {signal.Signals(signum).name}{': ' + said if said else ''}")
    return 128 + signum


def said_error(text: str) -> None:
    """`raywds: error: TEXT` on stderr in one write: the ranks of a torchrun or Ray run share one
    pipe, and print's two writes (the text, then its newline) let another rank's line land between
    them, which split neither line and joined both."""
    sys.stderr.write(f"raywds: error: {text}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = MainOptions(**values(args, MainOptions)).debug
    _stopping[0], _signalled[0] = 0.0, 0
    signal.signal(signal.SIGTERM, _stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (nohup)
        signal.signal(signal.SIGINT, _stop)
    console.configure()
    try:
        COMMANDS[args.command](*command_options(args))  # options that do not hold are one line too
    except RaywdsError as e:
        if debug:
            traceback.print_exc()
        lines = one_line(e).splitlines() or [""]
        said_error("\n".join(lines))
        return int(getattr(e, "exit_code", 1))
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        code = _stopped(args.command, e)
        if argv is None:  # this process is the command (not a caller's main([...])): that line is its last
            hush()
        return code
    return 0


def hush() -> None:
    """Nothing more on this process's stdout and stderr. What a library says as the process exits
    after a stop would follow the command's one line: Ray's core worker, shutting down with tasks
    under way, logs in C++ straight to fd 2 each one whose failure it could not report
    (`task_manager.cc: Failed to push error to driver for task ...`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.close(quiet)


if __name__ == "__main__":
    sys.exit(main())
