"""The 1F1B executor of mist.engine.run: a plan's micro-batches through megatron-core's stages with
point-to-point sends between them (megatron-core's own schedules assume CUDA); non-blocking
sends, so 1F1B cannot deadlock. The op order is the simulator's (``tuning.pipeline_sim``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Plan
from .layout import Message, RankLayout


class Pipeline1F1B:
    """One rank's part of a 1F1B iteration over G micro-batches. The activations between stages
    go as the layout's messages say (layout.py: one message each way between ranks of stages of
    the same shape; pieces of the micro-batch's sequences between stages whose TP/DP differ)."""

    def __init__(self, model, spec, plan: Plan, batches: list[torch.Tensor], layout: RankLayout) -> None:
        self.model, self.spec, self.plan, self.batches = model, spec, plan, batches
        rank = dist.get_rank()
        self.stage, tp_rank, dp_rank = layout.locate(rank)
        self.stages = len(plan.stages)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.sends, self.receives = layout.forward_sends(rank), layout.forward_receives(rank)
        self.grad_sends, self.grad_receives = layout.backward_sends(rank), layout.backward_receives(rank)
        self.grad_scale = 1.0 if self.last else layout.gradient_scale(self.stage)
        # megatron's [s, b, h] between stages: this rank's positions (SP: its shard) and sequences
        (s0, s1), (b0, b1) = layout.positions(self.stage, tp_rank), layout.rows(self.stage, dp_rank)
        self.shape = (s1 - s0, b1 - b0, spec.hidden)
        self.device = batches[0].device
        self.mask = (
            torch.ones(1, 1, spec.seq, spec.seq, dtype=torch.bool, device=self.device).tril().logical_not()
        )

    def _receive(self, messages: list[Message]) -> torch.Tensor:
        """This rank's [s, b, h] from its pieces (one message of all of it: received in place)."""
        whole = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for m in messages:
            if (m.seq_lo, m.seq_hi, m.lo, m.hi) == (0, self.shape[0], 0, self.shape[1]):
                dist.recv(whole, m.peer)
                continue
            size = (m.seq_hi - m.seq_lo, m.hi - m.lo, self.shape[2])
            piece = torch.empty(size, dtype=self.dtype, device=self.device)
            dist.recv(piece, m.peer)
            whole[m.seq_lo : m.seq_hi, m.lo : m.hi] = piece
        return whole

    @staticmethod
    def _send(t: torch.Tensor, messages: list[Message], pending: list) -> None:
        for m in messages:
            pending.append(dist.isend(t[m.seq_lo : m.seq_hi, m.lo : m.hi].contiguous(), m.peer))

    def forward(self, m: int, pending: list):
        tokens = self.batches[m]
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(self.spec.seq, device=self.device).expand(ids.shape[0], -1)
        received = None
        if not self.first:
            received = self._receive(self.receives).requires_grad_(True)
        self.model.set_input_tensor(received)
        out = self.model(ids, pos, self.mask, labels=labels if self.last else None)
        if self.last:
            out = out.float().mean() / len(self.batches)
        else:
            self._send(out.detach(), self.sends, pending)
        return received, out

    def backward(self, received, out, pending: list) -> None:
        if self.last:
            out.backward()
        else:
            grad = self._receive(self.grad_receives)
            if self.grad_scale != 1.0:
                grad *= self.grad_scale
            torch.autograd.backward(out, grad)
        if received is not None:
            self._send(received.grad, self.grad_sends, pending)

    def iteration(self) -> float:
        from ..tuning.pipeline_sim import one_f_one_b_order

        self.dtype = next(self.model.parameters()).dtype
        saved, pending, loss = {}, [], 0.0
        for kind, m in one_f_one_b_order(self.stage, self.stages, len(self.batches)):
            if kind == "F":
                saved[m] = self.forward(m, pending)
            else:
                received, out = saved.pop(m)
                if self.last:
                    loss += float(out.detach()) * len(self.batches)
                self.backward(received, out, pending)
        for work in pending:
            work.wait()
        return loss / len(self.batches)
