"""The compile jobs' process pool, shared by ``build-kernels`` (:mod:`flash_attn.kernel_build.build`)
and ``amd-kernels`` (:mod:`flash_attn.kernel_build.amd`): each job a plain dict handed to a
function in a spawned worker process (a fresh interpreter: Triton's state and environment stay
the worker's), results taken as they complete, one progress line or tqdm step per job.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Callable, Iterator

__all__ = ["JobFailed", "Progress", "completed"]


class JobFailed(RuntimeError):
    """A job's function raised: the message names the job (its label) and the error."""


class Progress:
    """tqdm when installed, else one line per completed job with counts and ETA (``quiet``: none)."""

    def __init__(self, total: int, quiet: bool, desc: str = "build-kernels"):
        self.total, self.done, self.start, self.quiet = total, 0, time.time(), quiet
        self.bar = None
        if not quiet:
            try:
                from tqdm import tqdm  # noqa: PLC0415

                self.bar = tqdm(total=total, unit="kernel", desc=desc, file=sys.stderr)
            except ImportError:
                pass

    def update(self, label: str) -> None:
        self.done += 1
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        elapsed = time.time() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {elapsed:5.0f}s elapsed, ETA {eta:4.0f}s  {label}", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def completed(fn: Callable[[dict], object], work: list, workers: int, progress: Progress,
              label: Callable[[dict], str], in_process: bool = False) -> Iterator[tuple[dict, object]]:
    """``(job, fn(job))`` for every job of ``work``, in the order they complete, ``fn`` running in
    ``workers`` spawned processes (``in_process`` with one worker: in this process, in order); the
    progress advanced by ``label(job)`` after each. A job whose ``fn`` raises cancels the jobs not
    yet started and raises :class:`JobFailed`."""
    if in_process and workers <= 1:
        for job in work:
            try:
                result = fn(job)
            except Exception as exc:  # noqa: BLE001
                raise JobFailed(f"{label(job)}: {exc}") from exc
            progress.update(label(job))
            yield job, result
        return
    import multiprocessing  # noqa: PLC0415

    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(fn, job): job for job in work}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001
                    for other in pending:
                        other.cancel()
                    raise JobFailed(f"{label(job)}: {exc}") from None
                progress.update(label(job))
                yield job, result
