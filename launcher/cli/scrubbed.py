"""What `launch` and `launcher` print, scrubbed of secrets: error reports (Hydra's own, a traceback,
a SystemExit message) and the configs Hydra shows (--cfg, --help, --hydra-help, --info).

Such a message echoes the command line (Hydra's "To append to your config use +KEY=VALUE", "Ambiguous
value for argument ...", "Error executing job with overrides: [...]") whatever is wrong with it, so
the values to scrub are read from the command line itself (secrets.override_secrets: secret-named
keys, setup-line assignments, URL passwords) and the environment's secret-named variables; a shown
config adds its own (secrets.known_secrets). The key stays in the message, the value never does.
Scrubbing only ever touches what is printed: nothing here changes what a job runs.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from typing import Any, Dict, Iterable, Iterator

from launcher.archive import secrets


def command_secrets(args: Iterable[str]) -> Dict[str, str]:
    """The secret values a command line of overrides and the environment hold."""
    known = secrets.known_secrets(env=os.environ)
    known.update(secrets.override_secrets(args))
    return known


def report(exc: BaseException, known: Dict[str, str], prog: str) -> str:
    """What to print for an exception, scrubbed: a Hydra error its message (and its OmegaConf
    cause), a config error its key and why, anything else its traceback (all of it where
    HYDRA_FULL_ERROR=1 asks for it)."""
    # lazy: `launcher --help` never loads Hydra or OmegaConf
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    if isinstance(exc, CompactHydraException) and not full:
        text = str(exc)
        if isinstance(exc.__cause__, OmegaConfBaseException):
            text += "\n" + str(exc.__cause__)
    elif isinstance(exc, OmegaConfBaseException) and not full:
        key = getattr(exc, "full_key", None)
        text = (f"{key}: " if key else "") + f"{getattr(exc, 'msg', None) or exc} ({type(exc).__name__})"
    else:
        tb = exc.__traceback__
        while not full and tb is not None and tb.tb_next is not None and \
                str(tb.tb_frame.f_globals.get("__name__", "")).startswith(("hydra.", __name__)):
            tb = tb.tb_next  # Hydra's own frames above the app's, as Hydra leaves them out
        text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    return secrets.scrub(f"{prog}: {text}", known)


class ScrubbingWriter(io.TextIOBase):
    """A text stream that writes to ``stream`` with every value of ``known`` (a dict that may still
    grow) replaced."""

    def __init__(self, stream: Any, known: Dict[str, str]) -> None:
        self.stream, self.known = stream, known

    def write(self, text: str) -> int:
        self.stream.write(secrets.scrub(text, self.known))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    @property
    def errors(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "errors", "strict")

    def __getattr__(self, name: str) -> Any:  # buffer, line_buffering ...: the stream's own
        return getattr(self.stream, name)


@contextlib.contextmanager
def errors_scrubbed(args: Iterable[str], prog: str) -> Iterator[Dict[str, str]]:
    """Run a command's block with its error output scrubbed: an exception leaving it is printed by
    ``report`` (exit 1), a SystemExit message is scrubbed, and so is whatever it writes to stderr."""
    known = command_secrets(list(args))
    stderr = sys.stderr
    sys.stderr = ScrubbingWriter(stderr, known)  # type: ignore[assignment]
    try:
        yield known
    except SystemExit as e:
        if isinstance(e.code, str):
            raise SystemExit(secrets.scrub(e.code, known)) from None
        raise
    except Exception as e:
        print(report(e, known, prog), file=stderr)
        raise SystemExit(1) from None
    finally:
        sys.stderr = stderr


def _shows_config(args: Iterable[str]) -> bool:
    """Whether Hydra's command line asks it to show something (--cfg, --help, --hydra-help, --info,
    --shell-completion) instead of running the app."""
    from hydra._internal.utils import get_args_parser  # Hydra's own parser: its flags, as it reads them

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a bad flag: Hydra itself says so, later
            ns, _ = get_args_parser().parse_known_args(list(args))
    except SystemExit:
        return False
    return bool(ns.cfg or ns.info or ns.help or ns.hydra_help or ns.shell_completion)


def _app_part(cfg: Any) -> Any:  # a Hydra app's own config: any shape
    """The app's config without the hydra node (which resolves only once Hydra has set it), to resolve."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    return OmegaConf.create(plain)


@contextlib.contextmanager
def hydra_scrubbed(args: Iterable[str], prog: str = "launch") -> Iterator[Dict[str, str]]:
    """Run a Hydra app's main with what Hydra prints scrubbed: its error reports (Hydra's
    run_and_report, which prints an exception with the overrides it echoes) and, for a command that
    only shows a config (``--cfg job``, ``--info config`` ...), everything it writes, with the secrets
    of each config it composed to show."""
    # lazy: `launch --help` pays for this only once Hydra runs anyway
    import hydra._internal.hydra as hydra_core
    import hydra._internal.utils as hydra_utils

    args = list(args)
    with errors_scrubbed(args, prog) as known:

        def run_and_report(func: Any) -> Any:
            try:
                return func()
            except Exception as ex:
                print(report(ex, known, prog), file=sys.stderr)
                sys.exit(1)

        saved = hydra_utils.run_and_report, hydra_core.run_and_report, hydra_core.Hydra.compose_config
        hydra_utils.run_and_report = hydra_core.run_and_report = run_and_report
        shows = _shows_config(args)
        if shows:
            def compose_config(self: Any, *a: Any, **kw: Any) -> Any:
                cfg = saved[2](self, *a, **kw)
                known.update(secrets.known_secrets([_app_part(cfg)]))  # its own (a cluster yaml's env ...)
                return cfg

            hydra_core.Hydra.compose_config = compose_config  # type: ignore[method-assign]
        stdout = sys.stdout
        if shows:  # nothing runs: all it prints is the config (or help holding it)
            sys.stdout = ScrubbingWriter(stdout, known)  # type: ignore[assignment]
        try:
            yield known
        finally:
            sys.stdout = stdout
            hydra_utils.run_and_report, hydra_core.run_and_report, hydra_core.Hydra.compose_config = saved
