"""One generation at a time per loaded pair, in a worker thread, behind a bounded queue.

Decoding is synchronous CPU work that already uses every core, so requests take turns: a
request is admitted while fewer than ``1 + queue`` are running or waiting, and refused
otherwise (the app answers 429). Each generation runs alone on the pair with its own seed, so
its text does not depend on what else is being served. Text pieces cross to the event loop
round by round; a cancelled job (its client went away, the server is stopping) is seen by the
thread between two rounds and its generation ends there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from edgespec.runtime.pipeline import GenerationResult, TextStream


class Busy(Exception):
    """Every place in the queue is taken."""


class Cancelled(Exception):
    """The generation was cancelled before it finished (the server is stopping)."""


@dataclass
class Counts:
    """What /health reports: generations now, and since the server started."""

    running: int = 0
    waiting: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0


class Job:
    """One admitted generation: iterate for its text pieces, then its GenerationResult."""

    def __init__(self, stream: TextStream, loop: asyncio.AbstractEventLoop):
        self.stream = stream
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """End the generation at its next round (or before it starts), whether or not its
        rounds make text (special tokens, a held-back stop string or character make none)."""
        self._cancel.set()
        self.stream.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def send(self, item: str | GenerationResult | BaseException) -> None:
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
                if isinstance(item, BaseException):
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
    """Runs jobs one at a time in a single thread, for the event loop that submits them."""

    def __init__(self, queue: int):
        self.capacity = 1 + queue  # the running generation and those waiting for it
        self._counts = Counts()
        self._lock = threading.Lock()  # counts change in both the loop and the thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="edgespec-generate")
        self._closing = threading.Event()
        self._running: Job | None = None  # the job the thread is generating, for close()

    def counts(self) -> dict:
        with self._lock:
            return asdict(self._counts)

    def submit(self, stream: TextStream) -> Job:
        """Queue a generation, or raise Busy when every place is taken."""
        with self._lock:
            if self._closing.is_set() or (
                    self._counts.running + self._counts.waiting >= self.capacity):
                self._counts.refused += 1
                raise Busy()
            self._counts.waiting += 1
        job = Job(stream, asyncio.get_running_loop())
        self._executor.submit(self._generate, job)
        return job

    def _generate(self, job: Job) -> None:
        """In the worker thread: run the stream, checking for cancellation between rounds."""
        with self._lock:
            self._counts.waiting -= 1
            self._counts.running += 1
        outcome = "cancelled"
        self._running = job
        try:
            if self._closing.is_set():  # close() came before this job started
                job.cancel()
            for piece in job.stream:  # a cancelled stream ends at its next round
                job.send(piece)
            if not self._stopped(job):
                outcome = "completed"
                job.send(job.stream.result)
            if outcome == "cancelled":  # whoever still listens stops waiting
                job.send(Cancelled("the generation was cancelled: the server is stopping"))
        except Exception as e:  # the request answers with it
            outcome = "failed"
            job.send(e)
        finally:
            self._running = None
            with self._lock:
                self._counts.running -= 1
                setattr(self._counts, outcome, getattr(self._counts, outcome) + 1)

    def _stopped(self, job: Job) -> bool:
        return job.cancelled or self._closing.is_set()

    def close(self) -> None:
        """Refuse new jobs, end running ones at their next round, wait for the thread."""
        self._closing.set()
        if (running := self._running) is not None:
            running.cancel()
        self._executor.shutdown(wait=True)
