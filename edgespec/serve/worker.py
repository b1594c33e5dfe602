"""One generation at a time per loaded pair, in a worker thread, behind a bounded queue.

Decoding is synchronous CPU work that already uses every core, so requests take turns. A
request takes its place in the queue when it arrives, before its prompt is tokenized or its
chat template rendered: ``admit`` counts it among the ``1 + queue`` places (running or
waiting) and refuses it when all are taken (the app answers 429), so a flood of large prompts
is refused at once instead of being tokenized ahead of everyone. Once its prompt is ready,
``start`` hands its generation to the thread. Each generation runs alone on the pair with its
own seed, so its text does not depend on what else is being served. Text pieces cross to the
event loop round by round; a cancelled job (its client went away, the server is stopping, its
time ran out) is seen by the thread between two rounds and its generation ends there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from queue import SimpleQueue

from edgespec.errors import one_line
from edgespec.runtime.pipeline import GenerationResult, TextStream

TIME_LIMIT = "time_limit"  # the finish reason of a generation that ran out of time


class Busy(Exception):
    """Every place in the queue is taken."""


class Closing(Exception):
    """The server is stopping: no new work is admitted."""


class Cancelled(Exception):
    """The generation was cancelled before it finished (the server is stopping)."""


class NativeFault(Exception):
    """A BaseException that is not an Exception, raised by a native library: tokenizers
    reports a Rust panic as pyo3's PanicException. Carried as an Exception so that the
    request answers a 500 instead of the exception escaping every handler."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {one_line(error, 200)}")


@dataclass
class Counts:
    """What /health reports: requests now, and since the server started. ``waiting``: admitted
    and not yet generating (their prompts being tokenized, or queued behind the running one)."""

    running: int = 0
    waiting: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0


class Job:
    """One admitted request: ``start`` it with its stream, then iterate for its text pieces
    and its GenerationResult."""

    def __init__(self, loop: asyncio.AbstractEventLoop, time_limit_s: float | None):
        self.stream: TextStream | None = None
        self.time_limit_s = time_limit_s
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.expired = False  # its time ran out: the stream was cancelled by the clock
        self.prompt_tokens = 0  # the user's prompt, as the usage counts it

    def cancel(self) -> None:
        """End the generation at its next round (or before it starts), whether or not its
        rounds make text (special tokens, a held-back stop string or character make none)."""
        self._cancel.set()
        if self.stream is not None:
            self.stream.cancel()

    def expire(self) -> None:
        """The time limit: the generation ends at its next round, as if max_tokens were hit."""
        self.expired = True
        if self.stream is not None:
            self.stream.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def send(self, item: str | GenerationResult | Exception) -> None:
        """From the worker thread: hand one item to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            self._cancel.set()

    async def __aiter__(self) -> AsyncIterator[str | GenerationResult]:
        """Leaving this iteration early (a closed client, a cancelled task) cancels the job."""
        try:
            while True:
                item = await self._items.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, GenerationResult):
                    return
        finally:
            self.cancel()

    async def result(self) -> GenerationResult:
        async for item in self:
            if isinstance(item, GenerationResult):
                return item
        raise RuntimeError("a job ended without a result")  # unreachable: __aiter__ raises


class Worker:
    """Admits requests into a bounded queue and runs their generations one at a time in a
    single daemon thread (one that never holds up the process's exit)."""

    def __init__(self, queue: int,
                 on_result: Callable[[GenerationResult, int], None] | None = None):
        self.capacity = 1 + queue  # the running generation and those waiting for it
        self._counts = Counts()
        self._lock = threading.Lock()  # counts change in both the loop and the thread
        self._queue: SimpleQueue = SimpleQueue()
        self._closing = threading.Event()
        self._jobs: set[Job] = set()  # admitted and not finished, for stop()
        self._on_result = on_result or (lambda result, prompt_tokens: None)  # for /metrics
        self._thread = threading.Thread(target=self._run, name="edgespec-generate", daemon=True)
        self._thread.start()

    def counts(self) -> dict:
        with self._lock:
            return asdict(self._counts)

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def admit(self, time_limit_s: float | None = None) -> Job:
        """A place in the queue for a request that has just arrived, or Busy when every place
        is taken (Closing when the server is stopping). Give it back with ``release`` if the
        request ends before ``start``."""
        with self._lock:
            if self._closing.is_set():
                raise Closing()
            if self._counts.running + self._counts.waiting >= self.capacity:
                self._counts.refused += 1
                raise Busy()
            self._counts.waiting += 1
            job = Job(asyncio.get_running_loop(), time_limit_s)
            self._jobs.add(job)
        return job

    def release(self, job: Job) -> None:
        """Free the place of an admitted job that will not generate (its prompt was refused)."""
        with self._lock:
            if job in self._jobs:
                self._jobs.discard(job)
                self._counts.waiting -= 1

    def start(self, job: Job, stream: TextStream) -> None:
        """Queue the admitted job's generation for the thread."""
        job.stream = stream
        if job.cancelled or self._closing.is_set():
            stream.cancel()
        self._queue.put(job)

    def submit(self, stream: TextStream, time_limit_s: float | None = None) -> Job:
        """``admit`` and ``start`` at once: a generation whose prompt is ready."""
        job = self.admit(time_limit_s)
        self.start(job, stream)
        return job

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self._generate(job)

    def _generate(self, job: Job) -> None:
        """In the worker thread: run the stream, checking for cancellation between rounds."""
        with self._lock:
            self._counts.waiting -= 1
            self._counts.running += 1
        outcome = "cancelled"
        clock = None
        if job.time_limit_s is not None:
            clock = threading.Timer(job.time_limit_s, job.expire)
            clock.daemon = True
            clock.start()
        try:
            if self._closing.is_set():  # stop() came before this job started
                job.cancel()
            for piece in job.stream:  # a cancelled stream ends at its next round
                job.send(piece)
            result = job.stream.result
            if not self._stopped(job):
                if job.expired and result.stats.finish_reason == "cancelled":
                    result.stats.finish_reason = TIME_LIMIT
                outcome = "completed"
                self._on_result(result, job.prompt_tokens)
                job.send(result)
            if outcome == "cancelled":  # whoever still listens stops waiting
                job.send(Cancelled("the generation was cancelled: the server is stopping"))
        except Exception as e:  # the request answers with it
            outcome = "failed"
            job.send(e)
        except BaseException as e:  # a native library's panic: a 500, never a hung request
            outcome = "failed"
            job.send(NativeFault(e))
        finally:
            if clock is not None:
                clock.cancel()
            with self._lock:
                self._jobs.discard(job)
                self._counts.running -= 1
                setattr(self._counts, outcome, getattr(self._counts, outcome) + 1)

    def _stopped(self, job: Job) -> bool:
        return job.cancelled or self._closing.is_set()

    def stop(self) -> None:
        """Refuse new jobs and cancel every admitted one: the running generation ends at its
        next round, queued ones before their first. Does not wait."""
        self._closing.set()
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()

    def close(self, timeout_s: float | None = None) -> None:
        """``stop``, then wait up to ``timeout_s`` for the thread to finish (None: as long as
        it takes)."""
        self.stop()
        self._queue.put(None)
        self._thread.join(timeout_s)
