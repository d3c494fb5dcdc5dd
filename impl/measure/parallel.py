"""Run independent, CPU-bound measurement points in worker processes, results as they finish."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch
from tqdm import tqdm


def _init_worker() -> None:
    torch.set_num_threads(1)  # fake-tensor estimates are Python-bound: one process per core instead
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def map_points(
    fn: Callable[..., object], todo: Sequence[tuple], jobs: int, desc: str
) -> Iterator[tuple[tuple, object, float]]:
    """Yield (args, fn(*args), seconds) for each args in ``todo`` as soon as it is done (any order).

    A failure cancels the queued points and is raised at once (not after the whole queue).
    """
    if not todo:
        return
    ctx = multiprocessing.get_context("spawn")  # no fork after torch has started threads
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx, initializer=_init_worker) as pool:
        futures = {pool.submit(_timed, fn, *args): args for args in todo}
        try:
            for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, unit="point"):
                yield futures[fut], *fut.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
