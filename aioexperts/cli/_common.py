"""What every command-line tool shares: the ``--help`` formatter, a quiet end on a closed pipe, the
check of a model file named on the command line (:func:`model_file`) and the check that an output
file destroys nothing (:func:`refuse_to_overwrite`)."""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import NoReturn

from .. import ConfigError, __version__

__all__ = (
    "OneLineParser",
    "BROKEN_PIPE_STATUS",
    "EXTRAS",
    "INTERRUPTED_STATUS",
    "MAX_ROUNDS",
    "USAGE_STATUS",
    "HelpFormatter",
    "cache_error",
    "check_output_path",
    "error_text",
    "file_starts_with",
    "gate_weight",
    "input_file",
    "missing_extra",
    "model_file",
    "name_the_options",
    "plural",
    "refuse_to_overwrite",
    "sidecar_file_problem",
    "slab_note",
    "stdout_closed",
    "writable_dir",
)

#: Exit status when the reader of stdout went away (``tool | head``): 128 + SIGPIPE, what a shell
#: reports for a program the signal ended.
BROKEN_PIPE_STATUS = 141

#: Exit status of bad arguments or input files, found before any work (argparse's own).
USAGE_STATUS = 2

#: Exit status after Ctrl-C: 128 + SIGINT, what a shell reports for a program the signal ended.
INTERRUPTED_STATUS = 130


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``PROG: error: MESSAGE (see --help)``, exit
    :data:`USAGE_STATUS`) without the usage block; its subparsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_STATUS, f"{self.prog}: error: {message} (see --help)\n")


def add_version(parser: argparse.ArgumentParser, command: str) -> None:
    """``--version``: prints ``COMMAND VERSION`` (the package's version) and exits 0."""
    parser.add_argument("--version", action="version", version=f"{command} {__version__}")


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


_OPTIONS_FIELD = re.compile(r"\b[A-Z]\w*Options\.(\w+)(=?)")


def name_the_options(message: str, flags: Mapping[str, str]) -> str:
    """``message`` (a :class:`~aioexperts.ConfigError`'s) with each ``SomethingOptions.field`` of
    ``flags`` written as the command's option: ``SamplingOptions.temperature=-1.0 is outside ...``
    becomes ``--temp -1.0 is outside ...``."""

    def flag(m: re.Match[str]) -> str:
        name = flags.get(m.group(1))
        if name is None:
            return m.group(0)
        return name + (" " if m.group(2) else "")

    return _OPTIONS_FIELD.sub(flag, message)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun in the number it takes: ``plural(1, "token")`` is ``"1 token"``,
    ``plural(2, "token")`` ``"2 tokens"``, ``plural(0, "match", "matches")`` ``"0 matches"``."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def gate_weight(text: str) -> float:
    """``--miss-tier-weight``: a gate weight, a finite number >= 0, as :class:`~aioexperts.MissTier`
    accepts (a routing weight is 0..1 when a token's weights sum to 1, up to the model's
    ``expert_weights_scale`` when it scales them; a value above every weight sends every demand miss
    to the low tier). ``argparse.ArgumentTypeError`` otherwise, which argparse words as
    ``argument --miss-tier-weight: ...``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(
            f"must be a gate weight, a finite number >= 0 (routing weights are 0..1 for most models), got {text!r}"
        )
    return value


def slab_note(slots: int | None, cache_bytes: int | None, n_slots: int, slot_bytes: int) -> str | None:
    """What to say when the slab is not the size ``--slots`` / ``--cache-bytes`` asked for (the store
    raises a small one to its minimum and caps a large one at every expert of the model), else None."""
    got = f"the slab has {n_slots} slots of {slot_bytes} bytes ({n_slots * slot_bytes} bytes)"
    if slots is not None and n_slots != slots:
        why = "every expert of the model" if n_slots < slots else "the store's minimum"
        return f"--slots {slots}: {got}, {why}"
    if cache_bytes is not None:
        if n_slots * slot_bytes > cache_bytes:
            return f"--cache-bytes {cache_bytes} raised to the store's minimum: {got}"
        if cache_bytes - n_slots * slot_bytes >= slot_bytes:
            return f"--cache-bytes {cache_bytes} capped: {got}, every expert of the model"
    return None


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


def model_file(name: str) -> str:
    """The model file that the command-line argument ``name`` names (``~`` expanded), checked before
    anything is loaded, in the same words by every command: the caller prints ``PROG: error: MESSAGE``
    and exits with :data:`USAGE_STATUS`.

    The file is opened for reading once (and closed) so a file this user may not read is said here,
    not after a model load. A split set is named by any of its shards, which is a file as well.

    Returns:
        The path to open (``name`` with ``~`` expanded).

    Raises:
        ConfigError: ``NAME: no such model file``, ``NAME: is a directory, not a model file``,
            ``NAME: not a regular file, not a model file`` (a FIFO, a device) or
            ``NAME: cannot read the model file (REASON)``.
    """
    return input_file(name, "model file")


def input_file(name: str, what: str) -> str:
    """The input file that the command-line argument ``name`` names (``~`` expanded), checked as
    :func:`model_file` checks a model (``what`` names the kind: ``"model file"``, ``"trace file"``).

    Returns:
        The path to open (``name`` with ``~`` expanded).

    Raises:
        ConfigError: ``NAME: no such WHAT``, ``NAME: is a directory, not a WHAT``,
            ``NAME: not a regular file, not a WHAT`` or ``NAME: cannot read the WHAT (REASON)``.
    """
    path = os.path.expanduser(name)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such {what}") from None
    except (OSError, ValueError) as exc:  # EACCES on a directory of the path, ENAMETOOLONG, a NUL byte
        raise ConfigError(f"{name}: cannot read the {what} ({_reason(exc)})") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{name}: is a directory, not a {what}")
    if not stat.S_ISREG(mode):  # checked before the open: opening a FIFO would wait for a writer
        raise ConfigError(f"{name}: not a regular file, not a {what}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the {what} ({_reason(exc)})") from None
    os.close(fd)
    return path


def error_text(exc: BaseException) -> str:
    """``exc`` as one line for ``PROG: error: ...``: an ``OSError`` as ``FILE: REASON`` (no
    ``[Errno N]``), anything else as its message."""
    if isinstance(exc, OSError) and exc.strerror:
        names = [n for n in (exc.filename, exc.filename2) if n is not None]
        return ": ".join([*(os.fsdecode(n) for n in names), exc.strerror]) if names else exc.strerror
    return str(exc)


def builtin_full_model(layers: int | None, rebuild: bool, say: Callable[[str], None]) -> str:
    """The built-in full model of ``layers`` layers (default ``DEFAULT_FULL_LAYERS``), written into
    the user cache once (progress on stderr; ``say`` tells that it is written or waited for).

    Raises:
        ConfigError: the cache folder cannot take it (:func:`cache_error`).
    """
    from ..testing import DEFAULT_FULL_LAYERS, ensure_full_model, print_progress

    n = layers or DEFAULT_FULL_LAYERS
    try:
        built = ensure_full_model(
            n,
            rebuild=rebuild,
            progress=print_progress(sys.stderr),
            on_build=lambda p: say(f"writing the built-in full model ({plural(n, 'layer')}) to {p} (once)"),
            on_wait=lambda: say("another run is writing the built-in model; waiting for it"),
        )
    except OSError as exc:
        raise cache_error(exc) from None
    return os.fspath(built)


def cache_error(exc: OSError) -> ConfigError:
    """The one-line error of a built-in model that cannot be written into the user cache
    (``$AIOEXPERTS_CACHE`` under a regular file, a folder this user may not write, a full disk):
    the folder, the reason (no errno, no traceback) and what to do. The caller prints
    ``PROG: error: MESSAGE`` and exits with :data:`USAGE_STATUS`."""
    from ..testing import cache_dir

    if isinstance(exc, NotADirectoryError | FileExistsError):
        reason = "a file stands where a folder of that path should be"
    else:
        reason = _reason(exc)
        if isinstance(exc.filename, str) and exc.filename not in reason:
            reason += f": {exc.filename}"
    return ConfigError(
        f"cannot write the built-in model into {cache_dir()} ({reason}); set $AIOEXPERTS_CACHE to a "
        "writable folder, or give a MODEL file"
    )


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file ``path`` names (symlinks followed), or None if there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def file_starts_with(magic: bytes) -> Callable[[str], bool]:
    """A test for :func:`refuse_to_overwrite`'s ``ours``: the file begins with ``magic``."""

    def test(path: str) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(magic)) == magic
        except OSError:
            return False

    return test


def refuse_to_overwrite(
    output: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    *,
    ours: Callable[[str], bool],
    force: bool = False,
    what: str = "output",
) -> None:
    """Refuse an output file whose writing would destroy something the tool did not make.

    Files are compared by device and inode, not by name, so ``dir/../MODEL``, a hard link or a
    symlink to an input is the input.

    Args:
        output: the file the tool is about to write (or replace).
        inputs: every file the tool reads (missing ones are ignored).
        ours: whether an existing ``output`` is a file of the kind the tool writes (replaced freely).
        force: replace an existing file that is not ``ours`` (never an input, never a directory).
        what: how the messages name the output (``"--out"``, ``"the map"``).

    Raises:
        ConfigError: ``output`` is one of ``inputs``, a symbolic link (``force`` or not), not a
            regular file, or exists, is not ``ours`` and ``force`` is off.
    """
    name = os.fspath(output)
    link = ConfigError(f"{what} {name} is a symbolic link: refusing to replace it (name the file itself)")
    target = _identity(name)
    if target is None:
        if os.path.islink(name):  # a dangling link: the file it names may be made later
            raise link
        return  # nothing there to lose
    for path in inputs:
        if _identity(os.fspath(path)) == target:
            raise ConfigError(f"{what} {name} is the input {os.fspath(path)}: refusing to write over it")
    if os.path.islink(name):  # --force would replace the link itself (/dev/stdout as root)
        raise link
    if not stat.S_ISREG(os.stat(name).st_mode):
        raise ConfigError(f"{what} {name} exists and is not a regular file")
    if not force and not ours(name):
        raise ConfigError(
            f"{what} {name} exists and is not a file this tool writes: refusing to replace it (--force replaces it)"
        )


#: a bench's ``--rounds`` at most (a typo of many digits would start an endless run)
MAX_ROUNDS = 1000


def writable_dir(directory: str) -> str | None:
    """None if a file can be created in ``directory`` (tried: a temporary file, removed at once), else why not."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".aioexperts-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(tmp)
    return None


def check_output_path(output: str, what: str) -> None:
    """Before a long run: ``output`` (named as given) can be created, or ConfigError saying why not
    (a directory; a folder that is missing or where no file can be made: :func:`writable_dir`)."""
    path = os.path.abspath(output)
    if os.path.isdir(path):
        raise ConfigError(f"{what} {output} is a directory; name the file to write")
    why = writable_dir(os.path.dirname(path))
    if why is not None:
        raise ConfigError(f"{what} {output}: cannot create a file in {os.path.dirname(path)}: {why}")


def sidecar_file_problem(value: str) -> str | None:
    """Why the ``--miss-tier`` file ``value`` cannot be a sidecar (missing, a directory, not a
    regular file), named as given; None when it is a regular file (checked against the model later)."""
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        return f"--miss-tier {value}: no such file (aioexperts-tier MODEL writes one)"
    if os.path.isdir(path):
        return f"--miss-tier {value}: is a directory, not a sidecar (aioexperts-tier MODEL writes one)"
    if not os.path.isfile(path):
        return f"--miss-tier {value}: not a regular file (aioexperts-tier MODEL writes one)"
    return None
