"""Errors a user can fix, and the one line that reports them at the command line.

    raise UserError("data.path", "'train.jsonl' does not exist", "check the path")
    # str(err) == "data.path: 'train.jsonl' does not exist; check the path"

    if __name__ == "__main__":
        cli_main(lambda: app.run(main))   # any exception -> "error: ..." on stderr, exit 2

`UserError` is the base of every error whose message already says what is wrong and what
to do (`config_lib.ConfigError`, `data.BadRow`, the model loaders' errors, ...).
`format_error` turns ANY exception into one line `error: <key or file>: <what>; <fix>`:
user errors as they are, common library exceptions (missing files, permissions, a full or
read-only disk, a missing package, device out of memory) rewritten to name the path and
the fix, anything else as its type and first line. `cli_main` runs a command's main under
it: one line on stderr and exit status 2 (130 after Ctrl-C); `--debug` anywhere on the
command line (removed before the program parses its flags) or `JAXRL_LLM_DEBUG=1` lets the
traceback through instead.
"""

from __future__ import annotations

import ast
import errno
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable

DEBUG_FLAG = "--debug"
DEBUG_ENV = "JAXRL_LLM_DEBUG"
EXIT_ERROR, EXIT_INTERRUPTED = 2, 130
_MAX_CHARS = 600  # a line a terminal shows whole-ish; user errors are never cut


class UserError(Exception):
    """An error the user can fix; its message is the whole report.

    Args:
      where: the config key, file or flag that is wrong (`data.path`, `/runs/a/config.json`);
        or, with `what` left out, an already formatted `<where>: <what>; <fix>` message.
      what: what is wrong with it.
      fix: what to do about it.
    """

    def __init__(self, where: str, what: str | None = None, fix: str = ""):
        message = where if what is None else f"{where}: {what}" + (f"; {fix}" if fix else "")
        super().__init__(message)
        self.where, self.what, self.fix = where, what, fix


class UnsupportedModelError(UserError, ValueError):
    """The checkpoint asks for an architecture or option the decoder does not implement."""


def free_space(path: str) -> str:
    """Free space on the file system holding `path` (or its nearest existing parent),
    e.g. "1.2 GiB free"; "" when it cannot be read."""
    path = os.path.abspath(path)
    while path != os.path.dirname(path) and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        free = float(shutil.disk_usage(path).free)
    except OSError:
        return ""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while free >= 1024 and len(units) > 1:
        free, units = free / 1024, units[1:]
    return f"{free:.1f} {units[0]} free"


_OS_ERRORS = {
    errno.ENOENT: ("no such file or directory", "check the path"),
    errno.EACCES: ("permission denied", "fix its permissions or choose another location"),
    errno.EPERM: ("operation not permitted", "fix its permissions or choose another location"),
    errno.EROFS: ("read-only file system", "choose a location on a writable disk"),
    errno.EISDIR: ("is a directory, a file was expected", "give the path of a file"),
    errno.ENOTDIR: ("a part of the path is not a directory", "check the path"),
    errno.EEXIST: ("already exists", "remove it or choose another name"),
}


def _os_error_line(err: OSError) -> str | None:
    path = err.filename
    if path is None:
        return None
    path = os.fsdecode(path)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_space(path)
        what = "no space left on device" + (f" ({free})" if free else "")
        return f"{path}: {what}; free some space or use a larger disk"
    what, fix = _OS_ERRORS.get(err.errno, (err.strerror or "cannot be used", "check the path"))
    return f"{path}: {what}; {fix}"


def _config_file_line(text: str) -> str | None:
    """ml_collections' multi-line report of a --config file that failed to load."""
    if "Failed loading config file" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    attempted = [line for line in lines if line.startswith("/") or line.endswith(".py")]
    path = attempted[0] if attempted else "--config"
    return f"--config: {path}: {lines[-1]}; check the path and that the file defines get_config()"


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is XLA's device out-of-memory error (RESOURCE_EXHAUSTED)."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text and "memory" in text.lower()


def format_error(err: BaseException) -> str:
    """The one line `error: ...` that reports `err` at the command line."""
    if isinstance(err, UserError):
        return f"error: {' '.join(str(err).split())}"
    if isinstance(err, KeyboardInterrupt):
        return "error: interrupted; work since the last checkpoint is lost"
    text = str(err)
    line = None
    if type(err).__module__.startswith("huggingface_hub"):
        line = (
            f"Hugging Face hub: {' '.join(text.split())[:300]}; check the network and the "
            "model name, or give a local model directory"
        )
    elif isinstance(err, OSError):
        line = _os_error_line(err) or _config_file_line(text)
    elif isinstance(err, SyntaxError) and err.filename:
        line = f"{err.filename} line {err.lineno}: {err.msg}; fix the file"
    elif isinstance(err, ModuleNotFoundError) and err.name:
        package = err.name.split(".")[0]
        line = f"{package}: python package not installed; pip install {package}"
    elif out_of_memory(err):
        line = (
            f"device out of memory ({_first_line(text)[:200]}); lower rollout.batch_size or "
            "rollout.max_new_tokens, raise optim.micro_batches, or set model.remat"
        )
    if line is None and isinstance(err, OSError | FloatingPointError | ValueError):
        # These carry a message written for people (ours name the key or file).
        line = _first_line(text) or type(err).__name__
    if line is None:
        line = f"{type(err).__name__}: {_first_line(text)}"
        line = f"{line[:_MAX_CHARS]} (unexpected; rerun with {DEBUG_FLAG} for the traceback)"
    return f"error: {line[:_MAX_CHARS]}"


def debug_requested(argv: list[str] | None = None) -> bool:
    """`--debug` on the command line or JAXRL_LLM_DEBUG=1 in the environment."""
    argv = sys.argv if argv is None else argv
    return DEBUG_FLAG in argv[1:] or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def cli_main(main: Callable[[], object]) -> None:
    """Runs a command-line program's `main()`, reporting any failure as one line.

    Removes `--debug` from `sys.argv` first (so absl and argparse never see it). Without
    debug, an exception prints `format_error(err)` on stderr and exits 2 (130 for
    Ctrl-C); with debug it propagates with its traceback. `SystemExit` passes through
    untouched (absl and argparse exit that way for usage errors and `--help`). A Ctrl-C
    that Python drops (raised inside a garbage-collection callback) still exits 130.
    """
    debug = debug_requested()
    sys.argv[1:] = [arg for arg in sys.argv[1:] if arg != DEBUG_FLAG]
    if not debug:
        sys.unraisablehook = _abort_on_swallowed_ctrl_c(sys.unraisablehook)
    try:
        main()
        _one_line_ctrl_c_at_exit()
    except SystemExit:
        _one_line_ctrl_c_at_exit()
        raise
    except BaseException as err:
        if debug:
            raise
        sys.stdout.flush()
        print(format_error(err), file=sys.stderr, flush=True)
        if isinstance(err, KeyboardInterrupt):
            # An abort: threads it cut short (an async checkpoint save) must not hold the
            # exit, which would otherwise join them. Open files are flushed by their
            # writers each step; a half-written checkpoint is deleted on the next start.
            os._exit(EXIT_INTERRUPTED)
        sys.exit(EXIT_ERROR)


def _abort_on_swallowed_ctrl_c(hook):
    """`sys.unraisablehook` that ends the program on a KeyboardInterrupt Python could not
    raise: a Ctrl-C whose handler ran inside a garbage-collection callback or a `__del__`
    (jax registers one with `gc.callbacks`) is printed and dropped there, and the run
    would go on as though the abort had not been asked for."""

    def handle(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _exit_interrupted(signal.SIGINT, None)
        hook(unraisable)

    return handle


def _one_line_ctrl_c_at_exit() -> None:
    """A Ctrl-C while the interpreter exits (atexit: jax's backend cleanup, orbax's
    threads) ends with the one line and 130, not a traceback from inside them."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_interrupted)


def _exit_interrupted(signum, frame) -> None:
    sys.stdout.flush()
    # os.write: the signal may have cut a write to stderr that print would re-enter.
    os.write(2, (format_error(KeyboardInterrupt()) + "\n").encode())
    os._exit(EXIT_INTERRUPTED)


def run_absl(main: Callable) -> None:
    """absl's `app.run(main)` for a program with ml_collections `--config` flags: a bad
    override, which ml_collections reports as an exception while absl parses the flags,
    becomes the one line it means (`error: --config: bad override: ...`), and so does a
    value of the wrong type (`parse_flags`)."""
    from absl import app, flags

    try:
        app.run(main, flags_parser=parse_flags)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        if flags.FLAGS.is_parsed():
            raise  # a failure of the program itself, not of the command line
        text = str(err).replace("\\n", " ").replace("\\", "").replace("'", "")
        raise UserError(
            "--config", f"bad override: {' '.join(text.split())}", "check the key and its type"
        ) from None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a value it cannot parse (`--config.model.lora.rank=4.5`,
    `--lora=pefft`) or an unknown flag reported as a `UserError`, one line and exit 2 like
    a key typo, instead of absl's "FATAL Flags parsing error" and exit 1."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        text = " ".join(str(err).split())
        where, sep, what = text.removeprefix("flag ").partition(": ")
        if not sep or not where.startswith("--"):
            where, what = "command line", text
        raise UserError(
            where, what, "check the value and its type (--helpfull lists the flags)"
        ) from None


# Config sections whose keys the user names: ml_collections overrides only keys a config
# already has, so `--config.agent.options.tries=2` (a new key) is taken here instead.
FREE_FORM_OVERRIDES = ("agent.options", "teacher.paths", "env.options")


def take_free_form(argv: list[str]) -> tuple[list[str], list[tuple[str, str, object]]]:
    """`--config.<section>.<name>=VALUE` overrides of the FREE_FORM_OVERRIDES sections
    taken out of `argv` -> (the rest, [(section, name, value)]); VALUE is a Python
    literal (`2`, `0.5`, `True`, `[1, 2]`) or else the string as written."""
    rest, taken = [], []
    for arg in argv:
        for section in FREE_FORM_OVERRIDES:
            prefix = f"--config.{section}."
            name, sep, text = arg[len(prefix) :].partition("=")
            if arg.startswith(prefix) and sep and name and "." not in name:
                taken.append((section, name, _literal(text)))
                break
        else:
            rest.append(arg)
    return rest, taken


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_free_form(config, taken: list) -> None:
    """Sets each (section, name, value) of `take_free_form` in `config` (locked or not)."""
    for section, name, value in taken:
        target = config
        for part in section.split("."):
            target = target[part]
        with target.unlocked():
            target[name] = value


def config_command(
    main: Callable, config_help: str, workdir_help: str, workdir_required: bool = True
) -> None:
    """The `python -m jaxrl_llm.<command> --config=FILE --workdir=DIR` entry point: the
    XLA flags for a CPU-only machine (`parallel.xla_flags`), the process re-run with
    tcmalloc where installed, the two required flags (`--config` with `--config.KEY=VALUE`
    overrides), and every failure as one line (`cli_main`)."""
    from absl import flags
    from ml_collections import config_flags

    from jaxrl_llm.parallel import allocator, xla_flags

    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()
    config_flags.DEFINE_config_file("config", None, config_help, lock_config=True)
    flags.DEFINE_string("workdir", None, workdir_help)
    flags.mark_flags_as_required(["config", "workdir"] if workdir_required else ["config"])
    sys.argv[1:], taken = take_free_form(sys.argv[1:])

    def main_with_free_form(argv):
        apply_free_form(flags.FLAGS.config, taken)
        return main(argv)

    cli_main(lambda: run_absl(main_with_free_form))
