"""How a long command (a benchmark, the cluster demo) ends on SIGINT or SIGTERM: it unwinds
through its own cleanup and exits with status 128 + the signal's number.

Python runs a signal's handler in the main thread wherever that thread is, and an exception
raised inside a finalizer (a `__del__` such as `subprocess.Popen`'s, which runs each time a
finished command's object goes, or a weakref callback) is reported and dropped. A signal
taken there would be lost: the benchmark would run on to its end and exit 0. So a dropped
SystemExit of ours sends the signal again, and a body that still ends normally after a
signal was taken exits with that signal's status."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESEND_S = 0.05  # after a finalizer dropped it: outside that finalizer by then


class _Taken:
    signum = 0  # the first signal taken (0: none)
    cleaning = False  # the cleanup started: later signals are ignored


@contextmanager
def ends_on_signal(cleanup: Callable[[], None]) -> Iterator[None]:
    """Run the body; on SIGINT/SIGTERM unwind it (SystemExit) and exit 128 + signum.
    `cleanup` runs in every case, once, after the body's own cleanup, and a second signal
    does not cut it short."""
    taken = _Taken()
    main = threading.get_ident()
    hook = sys.unraisablehook

    def resend() -> None:
        threading.Event().wait(RESEND_S)
        if not taken.cleaning:
            signal.pthread_kill(main, taken.signum)

    def dropped(unraisable) -> None:
        hook(unraisable)
        if taken.signum and not taken.cleaning and isinstance(unraisable.exc_value, SystemExit):
            threading.Thread(target=resend, name="distorefs-resend-signal", daemon=True).start()

    def interrupted(signum, frame) -> None:
        if taken.cleaning:
            return
        taken.signum = taken.signum or signum
        raise SystemExit(128 + taken.signum)

    before = {sig: signal.signal(sig, interrupted) for sig in SIGNALS}
    sys.unraisablehook = dropped
    try:
        yield
    finally:
        try:
            taken.cleaning = True
        finally:
            taken.cleaning = True  # again: a signal may have cut the line above short
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            try:
                cleanup()
            finally:
                sys.unraisablehook = hook
                for sig, handler in before.items():
                    signal.signal(sig, handler)
    if taken.signum:  # taken, and dropped where no resend reached: the body ran to its end
        raise SystemExit(128 + taken.signum)
