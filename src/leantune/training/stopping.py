"""Stopping a run on purpose: SIGTERM/SIGINT, out of memory, a non-finite step.

Each way a run ends early is an exception carrying the message a user needs and the exit code;
``leantune.finetuning.main`` prints the message (no traceback) and returns the code.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional


class RunStopped(Exception):
    """The run ended before its last step; the message says why and what to do."""

    exit_code = 1


class TrainingInterrupted(RunStopped):
    """SIGTERM or SIGINT: the step in progress finished, the training state was saved."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # what a shell reports for a process ended by that signal


class InterruptedBeforeTraining(KeyboardInterrupt):
    """SIGTERM or SIGINT while the run was still being set up: it ends there, with nothing to save.

    A ``KeyboardInterrupt``, like Ctrl-C's default, so that no library's ``except Exception``
    swallows it while weights load.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class NonFiniteStep(RunStopped):
    """A step's loss or gradient norm was NaN or infinite, beyond --skip_nonfinite_steps."""


class OutOfMemory(RunStopped):
    """The accelerator (or the host) ran out of memory; the message holds the report and the fixes."""


class OutOfMemoryInTraining(Exception):
    """An out-of-memory error in the training loop, raised outside its handler (the failed step's tensors freed
    first), with what the entry point needs to explain it: the error's own message, what was running, the last
    memory record, the plan's predicted peak. The advice is the planner's (``leantune.planning.oom_advice``); the
    loop only recognises the error."""

    def __init__(self, message: str, where: str, last_record: Optional[dict], predicted_peak_bytes: Optional[int],
                 allocator: tuple = (None, None)):
        """``allocator``: the CUDA allocator's summary and snapshot path, read in the handler while the failed
        step's tensors were alive (``memory.oom.allocator_state``)."""
        super().__init__(message)
        self.where, self.last_record, self.predicted_peak_bytes = where, last_record, predicted_peak_bytes
        self.allocator = allocator


class StopRequest:
    """Turns SIGTERM and SIGINT into a request the training loop honours after the current step.

    Until the training loop starts (``start_deferring``), a signal ends the run at once by raising
    ``InterruptedBeforeTraining``: loading and planning can take minutes and hold nothing to save.
    From then on the first signal only sets ``signum`` (the loop finishes the step, saves the
    training state, writes the metrics and raises ``TrainingInterrupted``). A second one exits at once: every file
    leantune writes is written aside and renamed into place, so exiting mid-write leaves the last
    complete version of each. Handlers are installed only in the main thread of the main process
    (forked DataLoader workers inherit them and ignore the signal) and restored on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: Optional[int] = None
        self.deferring = False
        self._closed = False
        self._previous: dict = {}
        self._pid = os.getpid()

    def start_deferring(self) -> None:
        """The training loop runs: from now on a signal waits for the end of the step.

        A signal seen during setup whose exception was swallowed (a library's ``except
        BaseException``, a finalizer) ends the run here, before any step.
        """
        if self.signum is not None:
            raise InterruptedBeforeTraining(f"stopped by {self.name} before training started; nothing was saved",
                                            self.signum)
        self.deferring = True

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True  # a signal now must not raise in the middle of restoring the handlers
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid or self._closed:  # a DataLoader worker (the main process decides), or done
            return
        name = signal.Signals(signum).name
        if not self.deferring:
            self.signum = signum
            raise InterruptedBeforeTraining(f"stopped by {name} before training started; nothing was saved", signum)
        if self.signum is not None:
            # os.write, not print: a handler may run in the middle of another print
            os.write(2, f"\nleantune: second {name}: exiting now; saved training states and metrics stay as "
                        "they were last written\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\nleantune: {name} received: finishing this step, then saving the training state "
                    f"(send it again to exit at once)\n".encode())


class NoStopRequest:
    """Never requests a stop (the planner and benchmarks drive the trainer without signal handlers)."""

    signum = None
    requested = False
    name = ""

    def start_deferring(self) -> None:
        pass
