"""What every command-line tool shares: the ``--help`` formatter and a quiet end on a closed pipe."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ("BROKEN_PIPE_STATUS", "EXTRAS", "HelpFormatter", "missing_extra", "stdout_closed")

#: Exit status when the reader of stdout went away (``tool | head``): 128 + SIGPIPE, what a shell
#: reports for a program the signal ended.
BROKEN_PIPE_STATUS = 141


#: The optional packages a command may need, and the extra of ``pyproject.toml`` that installs each.
EXTRAS = {"rich": "bench", "matplotlib": "plot"}


def missing_extra(command: str, exc: ModuleNotFoundError) -> SystemExit:
    """The one-line exit of ``command`` when an optional package is not installed.

    Raises:
        ModuleNotFoundError: ``exc`` again, when the missing module is not an optional extra.
    """
    root = (exc.name or "").partition(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        raise exc
    return SystemExit(f"{command}: error: {root} is not installed: pip install 'aioexperts[{extra}]'")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except a None default: the help text says what None means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def stdout_closed() -> int:
    """Handle a ``BrokenPipeError`` on stdout: nothing printed, returns :data:`BROKEN_PIPE_STATUS`.

    stdout is pointed at ``/dev/null`` so the interpreter's last flush of what is still buffered
    does not fail again with "Exception ignored ... BrokenPipeError" (the recipe of Python's
    ``signal`` documentation).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file descriptor (replaced, closed)
        pass
    return BROKEN_PIPE_STATUS
