"""The host optimizer step optimizer offloading runs (torch's fused CPU AdamW)."""

from __future__ import annotations

import time

import torch

# What a fused fp32 AdamW step moves per parameter: reads weight, gradient and both moments,
# writes weight and both moments.
ADAM_BYTES_MOVED = 28


def profile_cpu_adam(params: int = 1 << 24, threads: tuple[int, ...] = (1,), repeats: int = 5) -> dict:
    """Measure the host optimizer step mist.engine.run uses when it offloads optimizer state (torch's
    fused CPU AdamW on fp32 master weights): parameters per second with each thread count, median
    of ``repeats`` steps after a warm-up step. What ``model.runtime.cpu_adam_params_per_s`` prices from."""
    from measure.results import cpu_model

    if params < 1 or repeats < 1 or not threads or min(threads) < 1:
        raise ValueError("params, repeats and every thread count must be >= 1")
    before = torch.get_num_threads()
    rates = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            weight = torch.zeros(params, requires_grad=True)
            weight.grad = torch.randn(params)
            opt = torch.optim.AdamW([weight], lr=1e-3, fused=True)
            opt.step()  # allocates the moments
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            rates.append(params / sorted(times)[len(times) // 2])
    finally:
        torch.set_num_threads(before)
    return {
        "optimizer": "torch.optim.AdamW(fused=True), fp32, on the CPU",
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "params": params,
        "threads": list(threads),
        "params_per_s": rates,
        "bytes_moved_per_param": ADAM_BYTES_MOVED,
        "measured": time.strftime("%Y-%m-%d", time.gmtime()),
    }
