"""One training step in each precision the experiments use, with the optimizer that goes with it.

* ``fp32``      : float32 model, float32 AdamW.
* ``fp16``/``bf16``: the model itself in half precision; AdamW on float32 master weights
  (NVIDIA's BERT recipe). fp16 uses dynamic loss scaling.
* ``amp-fp16``/``amp-bf16``: float32 model under ``torch.autocast``; float32 AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

# AdamW's decoupled weight decay in every optimizer here, on the device and on the host alike
# (Megatron-LM's --weight-decay default): one value, so an offloaded share decays as the rest does
WEIGHT_DECAY = 0.01
# the dtype each name on a command line stands for (every CLI's --dtype)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# Each precision's (model dtype, autocast dtype or None, float32 master weights, dynamic loss
# scaling), as the module docstring says
_PRECISION = {
    "fp32": (torch.float32, None, False, False),
    "fp16": (torch.float16, None, True, True),
    "bf16": (torch.bfloat16, None, True, False),
    "amp-fp16": (torch.float32, torch.float16, False, False),
    "amp-bf16": (torch.float32, torch.bfloat16, False, False),
}
PRECISIONS = tuple(_PRECISION)


@dataclass(frozen=True)
class Precision:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.name!r}")

    @property
    def model_dtype(self) -> torch.dtype:
        return _PRECISION[self.name][0]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _PRECISION[self.name][1]

    @property
    def master_weights(self) -> bool:
        return _PRECISION[self.name][2]

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling: fp16's narrow exponent underflows small gradients without it."""
        return _PRECISION[self.name][3]

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)


def gradient_to_step(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient an optimizer steps ``p`` by: ``p.step_grad`` where a runtime put it there
    because ``.grad`` cannot hold it (a host sum of a parameter on a GPU, or a GPU sum of a weight
    resting on the host: ``.grad`` must be on its parameter's device; Megatron's ``main_grad``
    is the same idea), else ``p.grad``."""
    kept_apart = getattr(p, "step_grad", None)
    return p.grad if kept_apart is None else kept_apart


def to_across(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(device, dtype)``, crossing between devices in the narrower of ``t``'s dtype and
    ``dtype``: torch's copy between a GPU and the host converts on the host when blocking (and on
    the GPU when not), so an fp16 gradient on the host bound for an fp32 master on the GPU would
    otherwise cross as fp32, twice the bytes (copy_kernel_cuda; Mist's model prices 2 bytes)."""
    if t.device == device:
        return t.to(dtype)
    if t.element_size() > dtype.itemsize:
        return t.to(dtype).to(device)  # narrowed where it is
    return t.to(device).to(dtype)  # widened where it lands


def copy_across(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``, crossing between devices in the narrower dtype (to_across): an fp32
    master copied into an fp16 weight is narrowed where it is (into pinned memory where it was
    pinned, so a non-blocking copy up stays a DMA), an fp16 source widened where it lands."""
    crossing = dst.device != src.device
    if crossing and src.element_size() > dst.element_size():
        src = torch.empty_like(src, dtype=dst.dtype, pin_memory=src.is_pinned()).copy_(src)
    elif crossing and src.element_size() < dst.element_size():
        src = src.to(dst.device, non_blocking=non_blocking)
    dst.copy_(src, non_blocking=non_blocking)


class MasterWeightAdamW:
    """AdamW on float32 copies of half-precision parameters; the model keeps only half weights.

    step(): half grads (``gradient_to_step``: on the device or the host) -> float32 master grads on
    the masters' device, AdamW on the masters, masters copied back (to the host where a weight
    rests there).
    With ``loss_scale`` (fp16), grads are unscaled and a step with inf/NaN grads is skipped
    and the scale halved; the scale doubles after ``growth_interval`` clean steps.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-4,
        weight_decay: float = WEIGHT_DECAY,
        dynamic_loss_scale: bool = False,
        init_scale: float = 2.0**16,
        growth_interval: int = 1000,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.master_params = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.master_params, strict=True)}
        # fused=True (as Megatron's fused Adam) steps without temporaries; foreach=False one tensor
        # at a time, holding a few temporaries of the largest tensor
        self.inner = torch.optim.AdamW(
            self.master_params, lr=lr, weight_decay=weight_decay, foreach=foreach, fused=fused
        )
        self.loss_scale = init_scale if dynamic_loss_scale else 1.0
        self.dynamic = dynamic_loss_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0
        self.skipped_steps = 0

    @property
    def state(self):
        return self.inner.state

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.dynamic else loss

    @torch.no_grad()
    def step(self) -> bool:
        """Returns False when the step was skipped (fp16 overflow)."""
        for master, p in zip(self.master_params, self.model_params, strict=True):
            grad = gradient_to_step(p)
            master.grad = None if grad is None else to_across(grad, master.device, torch.float32)
        if self.dynamic:
            grads = [m.grad for m in self.master_params if m.grad is not None]
            found_inf = torch.zeros(1, device=grads[0].device)
            inv_scale = torch.full((1,), 1.0 / self.loss_scale, device=grads[0].device)
            # Unscale in place and flag inf/NaN in one fused pass, as torch's GradScaler does.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            # On fake tensors (memory estimation) the flag has no value: take the common path.
            if not is_fake(found_inf) and found_inf.item() > 0:
                self.loss_scale /= 2.0
                self._clean_steps = 0
                self.skipped_steps += 1
                self._drop_master_grads()
                return False
            self._clean_steps += 1
            if self._clean_steps % self.growth_interval == 0:
                self.loss_scale *= 2.0
        self.inner.step()
        for master, p in zip(self.master_params, self.model_params, strict=True):
            copy_across(p, master)  # a weight resting on the host: fp16 down, not fp32
        self._drop_master_grads()
        return True

    def master_on_device(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s fp32 master, on the device the step runs on (None: ``p`` is not stepped here).
        After a step it holds the values ``p`` was given, before their cast to ``p``'s dtype."""
        return self._master_of.get(id(p))

    def _drop_master_grads(self) -> None:
        for master in self.master_params:
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        out = list(self.master_params)
        for st in self.inner.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out


def make_optimizer(model: nn.Module, precision: Precision, lr: float = 1e-4):
    if precision.master_weights:
        return MasterWeightAdamW(model.parameters(), lr=lr, dynamic_loss_scale=precision.loss_scaling)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer holds between steps (states, master weights)."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.state_tensors()
    out: list[torch.Tensor] = []
    for st in optimizer.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A causal LM's loss in its logits' dtype: token t predicts token t + 1, the mean over every
    position whose label is not -100 (as HF's loss, which would cast the logits to float32)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def train_step(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    optimizer,
    precision: Precision,
    on_phase: Callable[[str], None] | None = None,
    loss_of: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """forward -> backward -> optimizer step -> grads freed. Returns the (detached) loss: the
    model's own (``model(**batch).loss``) or ``loss_of(model, batch)``."""
    device_type = next(model.parameters()).device.type
    phase = on_phase or (lambda _name: None)
    phase("forward")
    with precision.autocast(device_type):
        loss = model(**batch).loss if loss_of is None else loss_of(model, batch)
    phase("backward")
    scaled = optimizer.scale(loss) if isinstance(optimizer, MasterWeightAdamW) else loss
    scaled.backward()
    phase("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phase("done")
    return loss.detach()
