"""Single-GPU references for Y = act(X W1) W2 with the whole GPU (the same SM budget as the
ticketed kernel): back-to-back GEMMs, and row chunks whose two GEMMs overlap on two streams."""

from __future__ import annotations

import torch

from ctapipe.reference import activation


def back_to_back_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act: str) -> torch.Tensor:
    return activation(x @ w1, act) @ w2


class MicrobatchedMLP:
    """Chunk i's second GEMM (stream 2) runs while chunk i+1's first GEMM (stream 1) does."""

    def __init__(self, chunk: int, act: str) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk, self.act = chunk, act
        self.streams: dict[torch.device, tuple] = {}  # a device's two streams

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m % self.chunk:
            raise ValueError(f"chunk {self.chunk} must divide M={m}")
        y = torch.empty(m, w2.shape[1], dtype=x.dtype, device=x.device)
        if x.device.type != "cuda":  # no streams: the same arithmetic, one chunk after another
            for s in range(0, m, self.chunk):
                y[s : s + self.chunk] = activation(x[s : s + self.chunk] @ w1, self.act) @ w2
            return y
        if x.device not in self.streams:
            self.streams[x.device] = (torch.cuda.Stream(x.device), torch.cuda.Stream(x.device))
        first, second = self.streams[x.device]
        main = torch.cuda.current_stream(x.device)
        first.wait_stream(main)
        second.wait_stream(main)
        for s in range(0, m, self.chunk):
            with torch.cuda.stream(first):
                h = activation(x[s : s + self.chunk] @ w1, self.act)
                ready = torch.cuda.Event()
                ready.record(first)
            with torch.cuda.stream(second):
                second.wait_event(ready)
                y[s : s + self.chunk] = h @ w2
                h.record_stream(second)
        main.wait_stream(first)
        main.wait_stream(second)
        return y
