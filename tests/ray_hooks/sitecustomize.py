"""Loaded by every Python that Ray starts for tests/test_ray_serve.py (this folder is put on
their PYTHONPATH): with EDGESPEC_TEST_HOLD_DIR set, a generation whose prompt starts with
``HOLD <name>`` makes one piece and then waits until the file ``<name>`` exists in that
folder (or it is cancelled), then goes on as usual. So a test has a request under way in a
replica for as long as it needs, however fast the machine, and ends it when it chooses.
Without the variable (any other Python) this does nothing."""

import os

HOLD_DIR = os.environ.get("EDGESPEC_TEST_HOLD_DIR")
DEADLINE_S = 90  # a test that never releases its request still ends

if HOLD_DIR:
    import threading
    import time
    from pathlib import Path

    from edgespec.runtime.pipeline import Pipeline

    stream = Pipeline.stream

    class Held:
        def __init__(self, inner, release: Path):
            self.inner, self.release, self.cancelled = inner, release, threading.Event()

        def cancel(self):
            self.cancelled.set()
            self.inner.cancel()

        def __iter__(self):
            if not self.cancelled.is_set():
                yield "x"
            give_up = time.monotonic() + DEADLINE_S
            while not (self.release.exists() or self.cancelled.wait(0.05)):
                if time.monotonic() > give_up:
                    break
            yield from self.inner

        @property
        def result(self):
            return self.inner.result

    def held(self, prompt, *args, **kwargs):
        inner = stream(self, prompt, *args, **kwargs)
        if isinstance(prompt, str) and prompt.startswith("HOLD "):
            return Held(inner, Path(HOLD_DIR) / prompt.split()[1])
        return inner

    Pipeline.stream = held
