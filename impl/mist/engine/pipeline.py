"""The 1F1B executor of mist.engine.run: a plan's micro-batches through megatron-core's stages with
point-to-point sends between them (megatron-core's own schedules assume CUDA); non-blocking
sends, so 1F1B cannot deadlock. The op order is the simulator's (``tuning.pipeline_sim``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Plan


class Pipeline1F1B:
    """One rank's part of a 1F1B iteration over G micro-batches."""

    def __init__(self, model, spec, plan: Plan, batches: list[torch.Tensor]) -> None:
        from megatron.core import parallel_state as ps

        self.model, self.spec, self.plan, self.batches = model, spec, plan, batches
        self.stage, self.stages = ps.get_pipeline_model_parallel_rank(), len(plan.stages)
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.next = None if self.last else ps.get_pipeline_model_parallel_next_rank()
        self.prev = None if self.first else ps.get_pipeline_model_parallel_prev_rank()
        seq = spec.seq // plan.tp if plan.tp > 1 else spec.seq
        self.shape = (seq, plan.micro_batch, spec.hidden)  # megatron's [s, b, h] between stages
        self.device = batches[0].device
        self.mask = (
            torch.ones(1, 1, spec.seq, spec.seq, dtype=torch.bool, device=self.device).tril().logical_not()
        )

    def forward(self, m: int, pending: list):
        tokens = self.batches[m]
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(self.spec.seq, device=self.device).expand(ids.shape[0], -1)
        received = None
        if not self.first:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            dist.recv(received, self.prev)
            received.requires_grad_(True)
        self.model.set_input_tensor(received)
        out = self.model(ids, pos, self.mask, labels=labels if self.last else None)
        if self.last:
            out = out.float().mean() / len(self.batches)
        else:
            pending.append(dist.isend(out.detach().contiguous(), self.next))
        return received, out

    def backward(self, received, out, pending: list) -> None:
        if self.last:
            out.backward()
        else:
            grad = torch.empty(self.shape, dtype=out.dtype, device=self.device)
            dist.recv(grad, self.next)
            torch.autograd.backward(out, grad)
        if received is not None:
            pending.append(dist.isend(received.grad.contiguous(), self.prev))

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
