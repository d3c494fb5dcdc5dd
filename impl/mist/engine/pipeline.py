"""The pipeline executors of mist.engine.run: a plan's micro-batches through megatron-core's stages
with point-to-point sends between them (megatron-core's own schedules assume CUDA); non-blocking
sends, so neither schedule can deadlock. 1F1B, and interleaved 1F1B over a rank's model chunks
(``Plan.virtual_stages``); the op order is the simulator's (``tuning.pipeline_sim``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Plan
from .layout import Message, RankLayout


def _stage_io(layout: RankLayout, stage: int, tp_rank: int, dp_rank: int, spec, device) -> tuple:
    """(megatron's [s, b, h] between stages on this rank: its positions (SP: its shard) and
    sequences; the causal attention mask), shared by both executors."""
    (s0, s1), (b0, b1) = layout.positions(stage, tp_rank), layout.rows(stage, dp_rank)
    mask = torch.ones(1, 1, spec.seq, spec.seq, dtype=torch.bool, device=device).tril().logical_not()
    return (s1 - s0, b1 - b0, spec.hidden), mask


def _inputs(tokens: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, positions, labels) of a micro-batch of sequences of seq + 1 tokens."""
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    return ids, torch.arange(seq, device=tokens.device).expand(ids.shape[0], -1), labels


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
        self.device = batches[0].device
        self.shape, self.mask = _stage_io(layout, self.stage, tp_rank, dp_rank, spec, self.device)

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
        ids, pos, labels = _inputs(self.batches[m], self.spec.seq)
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


class ModelChunks(nn.Module):
    """A rank's model chunks under interleaved 1F1B (``Plan.virtual_stages``): chunk c of pipeline
    rank i is virtual stage c S + i, each built as megatron-core builds a stage. One module, so
    that the optimizer, gradient buffers and memory accounting see all of the rank's parameters."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


def gpt_modules(model: nn.Module) -> list[nn.Module]:
    """The megatron-core GPT models inside a rank's model (under their half-precision wrappers): its
    chunks in order, or the one stage."""
    return [c.module for c in model.chunks] if isinstance(model, ModelChunks) else [model.module]


class PipelineInterleaved:
    """One rank's part of an interleaved 1F1B iteration (Narayanan et al., SC'21) in megatron-core's
    op order (``pipeline_sim.interleaved_order``): every stage with the plan's TP and DP (Plan.check),
    so each activation goes whole to the rank at the same TP/DP place of the next pipeline rank,
    the last rank's chunk c to rank 0's chunk c + 1. Forward activations and backward gradients go
    with tags of their own: with two pipeline ranks both flow both ways between one pair, and each
    stream is received in the order it is sent."""

    FORWARD, BACKWARD = 0, 1  # message tags

    def __init__(
        self, model: ModelChunks, spec, plan: Plan, batches: list[torch.Tensor], layout: RankLayout
    ) -> None:
        self.chunks, self.spec, self.batches = list(model.chunks), spec, batches
        rank = dist.get_rank()
        self.stage, tp_rank, dp_rank = layout.locate(rank)
        self.stages, self.virtual = len(plan.stages), plan.virtual_stages
        self.next = layout.rank((self.stage + 1) % self.stages, tp_rank, dp_rank)
        self.previous = layout.rank((self.stage - 1) % self.stages, tp_rank, dp_rank)
        self.device = batches[0].device
        self.shape, self.mask = _stage_io(layout, self.stage, tp_rank, dp_rank, spec, self.device)

    def _first(self, chunk: int) -> bool:  # the model's first virtual stage
        return self.stage == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:  # the model's last virtual stage
        return self.stage == self.stages - 1 and chunk == self.virtual - 1

    def _receive(self, peer: int, tag: int) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(t, peer, tag=tag)
        return t

    def forward(self, chunk: int, m: int, pending: list):
        ids, pos, labels = _inputs(self.batches[m], self.spec.seq)
        received = None
        if not self._first(chunk):
            received = self._receive(self.previous, self.FORWARD).requires_grad_(True)
        model = self.chunks[chunk]
        model.set_input_tensor(received)
        last = self._last(chunk)
        # megatron's wrapper upcasts the output of the last pipeline rank's every chunk unless told
        # not to: only the model's last virtual stage's is the loss
        out = model(ids, pos, self.mask, labels=labels if last else None, fp32_output=last)
        if last:
            out = out.float().mean() / len(self.batches)
        else:
            pending.append(dist.isend(out.detach().contiguous(), self.next, tag=self.FORWARD))
        return received, out

    def backward(self, chunk: int, received, out, pending: list) -> None:
        if self._last(chunk):
            out.backward()
        else:
            torch.autograd.backward(out, self._receive(self.next, self.BACKWARD))
        if received is not None:
            pending.append(dist.isend(received.grad, self.previous, tag=self.BACKWARD))

    def iteration(self) -> float:
        from ..tuning.pipeline_sim import interleaved_order

        self.dtype = next(self.chunks[0].parameters()).dtype
        saved, pending, loss = {}, [], 0.0
        micro_batches = len(self.batches)
        for kind, chunk, m in interleaved_order(self.stage, self.stages, micro_batches, self.virtual):
            if kind == "F":
                saved[chunk, m] = self.forward(chunk, m, pending)
            else:
                received, out = saved.pop((chunk, m))
                if self._last(chunk):
                    loss += float(out.detach()) * micro_batches
                self.backward(chunk, received, out, pending)
        for work in pending:
            work.wait()
        return loss / micro_batches
