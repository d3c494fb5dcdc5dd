"""Peak memory of a whole training step, estimated without using the memory: run the step on
FakeTensors and follow every storage's life.

``LiveMemoryTracker`` is a TorchDispatchMode: each storage an op creates is added to the live
total (rounded up to the CUDA caching allocator's 512-byte granularity) and removed when its
last tensor dies (a weakref finaliser on the storage). The peak of that total over a step, plus
what was live before it (weights, optimizer state), is the estimate; at the peak we also record
what the live bytes were: parameters, master weights, optimizer state, gradients, activations
saved for backward, and everything else (temporaries, inputs).

Custom ops are opaque to the tracker (their fake kernels allocate only outputs): a caller whose
model runs custom ops passes ``op_workspace(op_name, args, kwargs, target) -> bytes``, the
transient workspace each op needs on the *target* device (Tempo's is
``tempo.ops.workspace_bytes``); the fake tensors themselves live on the CPU whatever the target.

``StepMemoryEstimator`` builds the model once under FakeTensorMode, takes one warm-up step (so
the optimizer state exists, as in every step after the first) and then estimates any batch
size; ``max_batch`` finds the largest batch under a memory budget.

``kept_scale`` (a ``KeptScale``) estimates a step that keeps another share of the same
activations (a model as ``torch.compile`` partitions it: measure.compiled gives the bytes it
keeps, not its peak): at every moment, the live activations saved for backward inside the
Transformer layers count ``layers`` of their bytes, those saved elsewhere (embedding, head,
loss) ``rest`` of theirs, and everything else (weights, gradients, the step's transients)
counts as run eagerly. Two shares, because compile saves unevenly: on Llama-3.2-1B with Tempo's
layers it keeps all the layers keep and half the head's, so one whole-model share would count
the layers low once the head's backward has freed its tensors. What a compiled step's fused
kernels do not materialise, or its recomputation adds, is not seen.

What it does not see: the CUDA context and cuBLAS/cuDNN workspaces (outside torch's
allocator) and allocator fragmentation. ``GpuBudget`` subtracts a documented reserve for them.
"""

from __future__ import annotations

import gc
import math
import numbers
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .checks import finite, whole
from .parallel import raise_if_interrupted
from .saved import cuda_like, storage_key
from .training import Precision, make_optimizer, optimizer_state_tensors, train_step
from .units import GiB

ALLOC_GRANULARITY = 512  # bytes; the CUDA caching allocator rounds every block up to this
PHASES = ("forward", "backward", "optimizer")
CATEGORIES = (
    "parameters",
    "master_weights",
    "optimizer_state",
    "gradients",
    "activations",
    "other",
    "workspace",
)


def round_alloc(nbytes: int, granularity: int = ALLOC_GRANULARITY) -> int:
    return -(-nbytes // granularity) * granularity if nbytes else 0


# A custom op's transient bytes on a target: (op name, args, kwargs, 'cuda' | 'cpu') -> bytes
OpWorkspace = Callable[[str, tuple, dict, str], int]


class LiveMemoryTracker(TorchDispatchMode):
    """Follows the bytes held by live storages through every dispatched op (``op_workspace``: see
    the module docstring)."""

    def __init__(
        self,
        granularity: int = ALLOC_GRANULARITY,
        snapshot_tolerance: float = 1e-3,
        target: str = "cuda",
        op_workspace: OpWorkspace | None = None,
    ) -> None:
        super().__init__()
        self.target = target
        self.op_workspace = op_workspace
        self.granularity = granularity
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.phase = "setup"
        self.peak_phase = "setup"
        self.peak_breakdown: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self._snapshot_at = 0
        self._tolerance = snapshot_tolerance
        self._classify: Callable[[], dict[str, int]] | None = None
        self._discounts: dict[int, float] = {}  # a marked storage -> the bytes not counted
        self.discount = 0.0  # their sum over the live marked storages

    def mark_saved(self, key: int, share: float) -> None:
        """A live storage (``track``'s key) kept for backward: only ``share`` of its bytes count
        from now on (KeptScale; above 1, more than them)."""
        if key in self.live and key not in self._discounts:
            self._discounts[key] = (1.0 - share) * self.live[key]
            self.discount += self._discounts[key]
            self._observe(self.current)  # a share above 1 raises the level

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        nbytes = round_alloc(st.nbytes(), self.granularity)
        self.live[key] = nbytes
        self.current += nbytes
        weakref.finalize(st, self._free, key)
        self._observe(self.current)

    def _observe(self, level: int, workspace: int = 0) -> None:
        """Record ``level`` (live bytes + a call's workspace) as a candidate peak, overall and
        for the current phase. The overall peak's breakdown costs a pass over live storages: it
        is refreshed only when the peak moved by more than the tolerance (peaks are exact)."""
        phase = self.phase
        if self._discounts:
            level -= round(self.discount)
        self.phase_peaks[phase] = max(level, self.phase_peaks.get(phase, -1))
        if level > self.peak:
            self.peak = level
            self.peak_phase = phase
            if self._classify is not None and level > self._snapshot_at * (1 + self._tolerance):
                self._snapshot_at = level
                self.peak_breakdown = {**self._classify(), "workspace": workspace}

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        if key in self._discounts:
            self.discount -= self._discounts.pop(key)
            if not self._discounts:
                self.discount = 0.0  # no float residue once none is marked

    def reset_peak(self) -> None:
        self.peak = self.current - round(self.discount)
        self._snapshot_at = 0
        self.peak_breakdown = {**self._classify(), "workspace": 0} if self._classify else {}
        self.phase_peaks = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        # Custom ops run opaquely (their fake kernels allocate only outputs): add the workspace
        # they declare for the duration of the call, on top of inputs and outputs.
        workspace = _declared_workspace(func, args, kwargs, self.target, self.op_workspace)
        if workspace:
            self._observe(self.current + workspace, workspace)
        return out


def _declared_workspace(func, args, kwargs, target: str, op_workspace: OpWorkspace | None) -> int:
    """Transient bytes the caller's ``op_workspace`` declares for this op (0 without one)."""
    if op_workspace is None:
        return 0
    try:
        name = func.name()
    except AttributeError:
        return 0
    return op_workspace(name, args, kwargs, target)


@dataclass
class PeakReport:
    batch_size: int
    peak_bytes: int
    peak_phase: str  # forward / backward / optimizer
    breakdown: dict[str, int] = field(default_factory=dict)  # at the peak, by CATEGORIES
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the peak within each phase

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _share(name: str, value: object) -> float:
    if isinstance(value, bool) or not (
        isinstance(value, numbers.Real) and math.isfinite(value) and value > 0
    ):
        raise ValueError(f"kept_scale's {name} must be a finite number above 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class KeptScale:
    """The shares of saved activations' bytes a step counts (module docstring): those saved inside
    the Transformer layers (``layers_of`` finds them) and those saved elsewhere."""

    layers: float
    rest: float
    layers_of: Callable[[nn.Module], Iterable[nn.Module]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", _share("layers", self.layers))
        object.__setattr__(self, "rest", _share("rest", self.rest))


def _count_depth(modules: Iterable[nn.Module], depth: list[int]) -> list:
    """Forward hooks keeping ``depth[0]`` = how many of ``modules`` are running; their handles."""

    def enter(*_) -> None:
        depth[0] += 1

    def leave(*_) -> None:
        depth[0] -= 1

    handles = []
    for m in modules:
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    return handles


class StepMemoryEstimator:
    """Peak memory of ``train_step`` for any batch size, on fake tensors; ``kept_scale``: the
    shares of the saved activations' bytes counted (module docstring; None: all of them;
    breakdowns stay the eager step's)."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        make_batch: Callable[[int], dict[str, torch.Tensor]],
        precision: Precision | str,
        device: str = "cpu",
        granularity: int = ALLOC_GRANULARITY,
        target: str = "cuda",
        op_workspace: OpWorkspace | None = None,
        kept_scale: KeptScale | None = None,
    ) -> None:
        if target not in ("cuda", "cpu"):
            raise ValueError(f"target must be 'cuda' or 'cpu', got {target!r}")
        if kept_scale is not None and not isinstance(kept_scale, KeptScale):
            raise ValueError(f"kept_scale must be a measure.memory.KeptScale or None, got {kept_scale!r}")
        self.kept_scale = kept_scale
        self.granularity = granularity
        self.target = target
        self.op_workspace = op_workspace
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        self.make_batch = make_batch
        self.device = device
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        with self.fake_mode, default_dtype(self.precision.model_dtype), torch.device(device):
            # Built directly in its dtype and device: Module.to() cannot swap fake parameters.
            self.model = build_model().train()
            self.optimizer = make_optimizer(self.model, self.precision)
            # Warm-up step at batch 1: creates the optimizer state that every later step has.
            train_step(self.model, make_batch(1), self.optimizer, self.precision)

    def _classifier(self, saved_keys: set[int]) -> Callable[[], dict[str, int]]:
        params = {storage_key(p) for p in self.model.parameters()} | {
            storage_key(b) for b in self.model.buffers()
        }
        master = {storage_key(p) for p in getattr(self.optimizer, "master_params", [])}
        state = {storage_key(t) for t in optimizer_state_tensors(self.optimizer)} - master

        def classify() -> dict[str, int]:
            grads = {storage_key(p.grad) for p in self.model.parameters() if p.grad is not None}
            grads |= {
                storage_key(p.grad)
                for p in getattr(self.optimizer, "master_params", [])
                if p.grad is not None
            }
            out = dict.fromkeys(CATEGORIES, 0)
            for key, nbytes in self._tracker.live.items():
                if key in params:
                    out["parameters"] += nbytes
                elif key in master:
                    out["master_weights"] += nbytes
                elif key in state:
                    out["optimizer_state"] += nbytes
                elif key in grads:
                    out["gradients"] += nbytes
                elif key in saved_keys:
                    out["activations"] += nbytes
                else:
                    out["other"] += nbytes
            return out

        return classify

    def _track_persistent(self, tracker: LiveMemoryTracker, batch) -> set[int]:
        """Track what is live before the step (the model's parameters and buffers, the optimizer's
        state, the batch); their storages' keys, which are not activations."""
        persistent = [
            *self.model.parameters(),
            *self.model.buffers(),
            *optimizer_state_tensors(self.optimizer),
        ]
        not_activations = set()
        for t in [*persistent, *tree_leaves(batch)]:
            if isinstance(t, torch.Tensor):
                tracker.track(t)
                not_activations.add(storage_key(t))
        return not_activations

    def peak(self, batch_size: int) -> PeakReport:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        saved_keys: set[int] = set()

        inside_layers = [0]  # how deep in the Transformer layers' forward (KeptScale)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            saved_keys.add(key)
            ks = self.kept_scale
            if ks is not None and key not in not_activations:  # weights and the batch are kept anyway
                tracker.mark_saved(key, ks.layers if inside_layers[0] else ks.rest)
            return t

        with self.fake_mode:
            batch = self.make_batch(batch_size)
            tracker = self._tracker = LiveMemoryTracker(
                self.granularity, target=self.target, op_workspace=self.op_workspace
            )
            not_activations = self._track_persistent(tracker, batch)
            tracker._classify = self._classifier(saved_keys)
            tracker.reset_peak()
            # Deterministic and conservative: garbage from earlier steps is collected first, and
            # none is collected mid-step (storages in reference cycles then die late, not early).
            gc.collect()
            gc.disable()
            layers = self.kept_scale.layers_of(self.model) if self.kept_scale is not None else ()
            hooks = _count_depth(layers, inside_layers)
            try:
                # On the CUDA target, dropout and SDPA keep what their CUDA kernels keep.
                cuda_ops = cuda_like() if self.target == "cuda" else nullcontext()
                with tracker, cuda_ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    train_step(
                        self.model,
                        batch,
                        self.optimizer,
                        self.precision,
                        on_phase=lambda p: setattr(tracker, "phase", p),
                    )
            finally:
                gc.enable()
                for hook in hooks:
                    hook.remove()
            report = PeakReport(
                batch_size,
                tracker.peak,
                tracker.peak_phase,
                dict(tracker.peak_breakdown),
                {k: v for k, v in tracker.phase_peaks.items() if k in PHASES},
            )
            del batch
        self._tracker = None
        # a Ctrl-C or SIGTERM raised in a finalizer or weakref callback (gc.collect() above runs
        # them) is printed and dropped by Python: tempo.maxbatch searched on and ended with status
        # 0 (test_tempo_faults' SIGTERM case, once in a loaded suite); the request it left stops
        # the run here
        raise_if_interrupted()
        return report

    def max_batch(self, usable_bytes: int, limit: int = 1 << 16) -> tuple[int, PeakReport | None]:
        """Largest batch whose estimated peak fits ``usable_bytes`` (0 if even batch 1 does not)."""
        return search_max_batch(self.peak, usable_bytes, limit)


def search_max_batch(
    peak: Callable[[int], PeakReport],
    usable_bytes: int,
    limit: int = 1 << 16,
    probes: tuple[int, int] = (8, 16),
) -> tuple[int, PeakReport | None]:
    """Largest b with peak(b) <= usable_bytes, for a peak non-decreasing in b.

    Within each phase the peak is affine in b, so two probes predict the boundary: b* = the
    smallest over phases of (usable - A_p) / B_p. b* and b* + 1 are then evaluated; if the
    prediction was off (allocator rounding, a phase changing shape), a local bracket grown from
    b* by doubling steps and bisection finds the exact boundary. Every answer is an evaluated
    point, never an extrapolation. ``peak`` should be memoised by the caller when several
    budgets are searched (the probes are then shared).
    """
    if not finite(usable_bytes):
        raise ValueError(f"usable_bytes must be a finite number of bytes, got {usable_bytes!r}")
    if not whole(limit, 1):
        raise ValueError(f"limit must be a whole number of sequences >= 1, got {limit!r}")
    cache: dict[int, PeakReport] = {}

    def fits(b: int) -> bool:
        if b not in cache:
            cache[b] = peak(b)
        return cache[b].peak_bytes <= usable_bytes

    if not fits(1):
        return 0, cache[1]
    b1, b2 = probes
    fits(b1), fits(b2)
    guess = _predicted_boundary((b1, cache[b1]), (b2, cache[b2]), usable_bytes, limit)

    if fits(guess):  # grow a bracket upwards from the guess
        lo, hi, step = guess, None, 1
        while hi is None:
            b = lo + step
            if b > limit:
                return lo, cache[lo]
            if fits(b):
                lo, step = b, step * 2
            else:
                hi = b
    else:  # grow it downwards
        hi, lo, step = guess, None, 1
        while lo is None:
            b = max(1, hi - step)
            if fits(b):
                lo = b
            else:
                hi, step = b, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, cache[lo]


def _predicted_boundary(
    probe1: tuple[int, PeakReport], probe2: tuple[int, PeakReport], usable_bytes: int, limit: int
) -> int:
    """The largest batch the two probes (batch, report) predict fits ``usable_bytes``, in [1,
    ``limit``]: each phase's peak is affine in the batch, and the tightest phase bounds it."""
    (b1, r1), (b2, r2) = probe1, probe2
    phases = (set(r1.phase_peaks) & set(r2.phase_peaks)) or {"all"}
    predictions = []
    for phase in phases:
        p1 = r1.phase_peaks.get(phase, r1.peak_bytes)
        p2 = r2.phase_peaks.get(phase, r2.peak_bytes)
        slope = (p2 - p1) / (b2 - b1)
        if slope > 0:
            predictions.append(b1 + (usable_bytes - p1) / slope)
        elif p1 > usable_bytes:
            predictions.append(0)
    guess = int(min(predictions)) if predictions else limit
    return min(max(guess, 1), limit)


def refine_max_batch(
    peak: Callable[[int], PeakReport], usable_bytes: int, start: int, limit: int = 1 << 16
) -> tuple[int, PeakReport]:
    """The boundary nearest ``start`` under a more exact ``peak`` (e.g. the full-depth estimate after
    a depth-extrapolated search): down while ``start`` does not fit, up while the next batch fits.
    Every answer is an evaluated point; 0 if batch 1 does not fit."""
    b = max(start, 1)
    report = peak(b)
    if report.peak_bytes > usable_bytes:
        while b > 1:
            b -= 1
            report = peak(b)
            if report.peak_bytes <= usable_bytes:
                return b, report
        return 0, report
    while b < limit:
        above = peak(b + 1)
        if above.peak_bytes > usable_bytes:
            break
        b, report = b + 1, above
    return b, report


class DepthExtrapolatedEstimator:
    """The same peak estimate for an N-layer model from two shallow copies of it (full width).

    Every layer of a Transformer stack holds the same bytes, so within each phase (forward,
    backward, optimizer) the peak is affine in the number of layers: estimating models of
    ``probe_layers`` = (n1, n2) layers and extrapolating each phase's peak to N is exact up to
    allocator rounding (byte-identical in tests/measure/test_measure.py and for BERT-Large), at a
    fraction of the cost. The overall peak is the largest extrapolated phase peak.
    Breakdowns are *not* extrapolated (the category a storage falls in at the peak does not
    scale with depth); take them from a full-depth ``StepMemoryEstimator`` when needed. Nor is a
    phase whose peak moves between parts of the model with depth (Tempo's chunked LM loss: the
    forward's peak is in the head at two layers, in the layers at sixteen): a maximum of two
    affine functions is not affine. ``refine_max_batch`` with the full-depth estimate fixes an
    answer found with this one.
    """

    def __init__(
        self,
        build_model: Callable[[int], nn.Module],
        make_batch: Callable[[int], dict[str, torch.Tensor]],
        precision: Precision | str,
        num_layers: int,
        probe_layers: tuple[int, int] = (1, 2),
        **kwargs,
    ) -> None:
        n1, n2 = probe_layers
        if not 1 <= n1 < n2 <= num_layers:
            raise ValueError(f"probe_layers {probe_layers}: need 1 <= n1 < n2 <= num_layers ({num_layers})")
        self.num_layers, self.probe_layers = num_layers, probe_layers
        self._shallow = [
            StepMemoryEstimator(lambda n=n: build_model(n), make_batch, precision, **kwargs) for n in (n1, n2)
        ]

    def peak(self, batch_size: int) -> PeakReport:
        (n1, n2), n = self.probe_layers, self.num_layers
        r1, r2 = (e.peak(batch_size) for e in self._shallow)
        t = (n - n1) / (n2 - n1)
        phases = {
            p: round(r1.phase_peaks[p] + t * (r2.phase_peaks[p] - r1.phase_peaks[p]))
            for p in r1.phase_peaks
            if p in r2.phase_peaks
        }
        top = max(phases, key=phases.__getitem__)
        return PeakReport(batch_size, phases[top], top, {}, phases)

    def max_batch(self, usable_bytes: int, limit: int = 1 << 16) -> tuple[int, PeakReport | None]:
        return search_max_batch(self.peak, usable_bytes, limit)
