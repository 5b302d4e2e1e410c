"""Stopping a run on a signal: SIGTERM (what schedulers send before preemption) or SIGINT (Ctrl-C) asks the run to
stop at the next step boundary with a checkpoint; a second SIGINT exits at once (status 130). No JAX here.

    EARLY.catch()            # MaxText/train.py, before its imports: a signal during them is kept, not lost
    with StopFlag() as stop: # takes over from EARLY (and replays what it caught); the previous handlers on exit
        ... if stop.set: save and return
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_now() -> None:
    """A second SIGINT: exit at once (status 130), saving nothing more."""
    print("\nSIGINT again: exiting now; the newest durable checkpoint is kept", file=sys.stderr, flush=True)
    os._exit(130)


class EarlySignals:
    """The stop signals that came before the trainer's StopFlag existed (during the command's imports)."""

    def __init__(self):
        self.received: list[int] = []

    def catch(self) -> None:
        # SIGTERM last: Python catches SIGINT itself from its start, so a handler for SIGTERM is what tells another
        # process (tests/test_resilience.py) that this one's handlers are in place.
        signal.signal(signal.SIGINT, self._record)
        signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum, _frame) -> None:
        self.received.append(signum)
        if self.received.count(signal.SIGINT) > 1:
            exit_now()


EARLY = EarlySignals()  # the process's one early catcher: signals are per process


class StopFlag:
    """`set` once SIGTERM or SIGINT came (`name` says which): the loop checkpoints at the next step boundary and
    returns. Installed only in the main thread; the previous handlers come back on exit. What `early` caught
    before it was installed sets it too."""

    def __init__(self, early: EarlySignals = EARLY):
        self.set, self.name, self.interrupts, self.previous, self.early = False, "SIGTERM", 0, {}, early

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        for signum in self.early.received:  # read after taking over: none is lost in between
            self._handle(signum, None)
        return self

    def _handle(self, signum, _frame):
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                exit_now()
            print("\nSIGINT: stopping after this step with a checkpoint (Ctrl-C again exits at once)",
                  file=sys.stderr, flush=True)
        if not self.set:
            self.set, self.name = True, signal.Signals(signum).name

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)

    def before_first_step(self, log) -> bool:
        """True (and says so) when a stop signal came before the first step: there is nothing to save."""
        if self.set:
            log(f"{self.name} during set-up, before the first step: nothing to save; stopping")
        return self.set
