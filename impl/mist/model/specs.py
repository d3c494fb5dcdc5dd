"""What the planner plans for: the model, the GPU, the cluster. Presets for the Mist paper's cases.

Every size here is in elements or bytes, every rate in per-second units; one dataclass each is
the single source of shapes and hardware numbers for the whole planner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from measure.checks import real, whole
from measure.datasheets import DATASHEETS, FP32_FLOPS
from measure.units import GB, GiB, MiB

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")


# The largest model the planner takes, each bound past every published dense transformer by a
# wide margin, so that a size past it is a typo or a unit slip, refused before a search that would
# not end (a search's work grows with the layers: 100 layers took 8 s on 2 L4s, 400 took 197 s,
# and `mist plan --layers 10000000` never ended) or a prediction in numbers no machine has:
MAX_MODEL_SIZES = {
    # twice the deepest (Llama 3.1 405B: 126 layers; PaLM 540B: 118)
    "layers": 256,
    # 5x the widest (Megatron-LM's 1T: 25,600; Llama 3.1 405B: 16,384)
    "hidden": 2**17,
    # 16x the largest vocabulary (Gemma's 256,000)
    "vocab": 2**22,
    # above the longest context any model is trained or served with (Llama 4 Scout: 10M tokens)
    "seq": 2**24,
    # 4x the hidden bound: every MLP published is at most ~5.3x its hidden (Llama 3.1 405B: 53,248)
    "ffn": 2**19,
}


def positive_int(value) -> bool:
    """A whole number above 0 (a bool is not one)."""
    return whole(value, 1)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, every choice that changes its cost an explicit field.

    The presets are three families: GPT-3 (LayerNorm, GELU MLP of 4h, learned positions), Llama
    (RMSNorm, SwiGLU MLP, rotary, grouped-query attention, no dropout) and Falcon (LayerNorm,
    attention and MLP in parallel on one shared norm, rotary). No biases (as in the profiled
    Megatron runs).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int = 50304
    seq: int = 2048
    ffn: int | None = None  # default: 4h; gated MLPs 8h/3 rounded up to 256
    kv_heads: int | None = None  # default: heads (multi-head attention)
    flash: bool = True  # FlashAttention: no s x s matrices kept or materialised
    dropout: float = 0.1  # hidden and attention dropout (Megatron's default)
    norm: str = "layernorm"  # or "rmsnorm" (no mean, no bias: half the parameters)
    gated_mlp: bool = False  # SwiGLU: down(silu(gate(x)) * up(x)) instead of down(gelu(up(x)))
    positions: str = "learned"  # learned absolute embeddings, or "rotary" (applied to q and k)
    parallel_block: bool = False  # attention and MLP side by side on one shared norm (Falcon)
    # Tempo's layers (arXiv 2210.10246; tempo.megatron): norms keep their output, GELU its output
    # and a bit, SwiGLU gate and up, dropouts a seed, the unfused attention core P and V
    tempo: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for field in ("hidden", "layers", "heads", "vocab", "seq"):
            value = getattr(self, field)
            if not positive_int(value):
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in ("ffn", "kv_heads"):
            value = getattr(self, field)
            if value is not None and not positive_int(value):
                raise ValueError(f"{field} must be a positive integer (or unset), got {value!r}")
        for field, most in MAX_MODEL_SIZES.items():
            value = getattr(self, field)
            if value is not None and value > most:
                raise ValueError(
                    f"{field} must be at most {most} (far beyond any published model: see "
                    f"mist.model.specs.MAX_MODEL_SIZES), got {value!r:.40}"
                )
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv})")
        for field in ("flash", "gated_mlp", "parallel_block", "tempo"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be true or false, got {getattr(self, field)!r}")
        if not real(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.tempo and self.parallel_block:  # tempo.megatron builds the sequential layer only
            raise ValueError("tempo: Tempo's layers are built as sequential layers, not the parallel block")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")

    @property
    def ffn_hidden(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.gated_mlp:
            return -(-(8 * self.hidden // 3) // 256) * 256
        return 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def with_(self, **changes) -> ModelSpec:
        return replace(self, **changes)


_SIZES = {  # the Mist paper's model sizes: hidden, layers, heads
    "1.3b": (2048, 24, 16),
    "2.7b": (2560, 32, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "22b": (6144, 48, 64),
}
# The families' layer choices (Llama trains without dropout; GPT-3 and Falcon keep Megatron's 0.1).
FAMILIES: dict[str, dict] = {
    "gpt3": {},
    "llama": {"norm": "rmsnorm", "gated_mlp": True, "positions": "rotary", "dropout": 0.0},
    "falcon": {"positions": "rotary", "parallel_block": True},
}
MODELS: dict[str, ModelSpec] = {
    f"{family}-{size}": ModelSpec(f"{family}-{size}", h, n, a, **choices)
    for family, choices in FAMILIES.items()
    for size, (h, n, a) in _SIZES.items()
}
# Tiny shapes that megatron-core trains on a CPU in seconds (mist.engine.run tests, CPU checks)
MODELS.update(
    {
        f"{family}-tiny": ModelSpec(f"{family}-tiny", 64, 4, 4, vocab=256, seq=32, **choices)
        for family, choices in FAMILIES.items()
    }
)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    flops: float  # dense fp16/bf16 tensor-core peak, FLOP/s
    memory: int  # bytes
    hbm_bw: float  # bytes/s
    host_bw: float  # host <-> device (PCIe) bytes/s per direction, spec
    l2: int  # bytes of L2 cache: memory-bound ops whose data fits there run faster than hbm_bw
    fp32_flops: float | None = None  # dense FP32 peak (no TF32), FLOP/s; None: not on record


@dataclass(frozen=True)
class LinkSpec:
    bw: float  # bytes/s per GPU (bus bandwidth, as NCCL reports it)
    latency: float  # s


@dataclass(frozen=True)
class HostSpec:
    """One node's host, what CPU offloading uses: its DRAM holds what is offloaded, its cores run
    the offloaded optimizer step, shared by every GPU of the node."""

    name: str
    memory: int  # bytes of DRAM per node
    cores: int  # physical cores per node
    mem_bw: float  # data-sheet DRAM bandwidth per node (sockets x channels x transfer rate x 8 B), bytes/s


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    host: HostSpec

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"need at least one node and one GPU per node, got {self.nodes} x {self.gpus_per_node}"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


# Peak numbers are the vendors' data-sheet values (dense, no sparsity).
GPUS: dict[str, GpuSpec] = {
    name: GpuSpec(name, d.flops, d.memory, d.hbm_bw, d.pcie_bw, d.l2, FP32_FLOPS.get(name))
    for name, d in DATASHEETS.items()
    if d.memory is not None  # the GPUs whose whole sheet is recorded (not the B200)
}
# this machine's CPU as a "device" for mist.engine.run checks: nominal rates (use `mist profile`)
GPUS["cpu"] = GpuSpec("cpu", 1e11, 16 * GiB, 20 * GB, 20 * GB, 32 * MiB)
# Links: NVLink bus bandwidth per GPU, or PCIe where a GPU has no NVLink; inter-node by NIC.
_LINKS = {
    "l4": (LinkSpec(16 * GB, 10e-6), LinkSpec(6.25 * GB, 20e-6)),  # PCIe 4.0 x16; 50 Gb/s
    "a10g": (LinkSpec(16 * GB, 10e-6), LinkSpec(12.5 * GB, 20e-6)),  # PCIe; 100 Gb/s
    "v100": (LinkSpec(DATASHEETS["v100"].nvlink_bw, 5e-6), LinkSpec(12.5 * GB, 10e-6)),  # 100 Gb/s NIC
    "a100-40gb": (LinkSpec(DATASHEETS["a100-40gb"].nvlink_bw, 5e-6), LinkSpec(50 * GB, 10e-6)),  # 4x100 Gb/s
    "h100": (LinkSpec(DATASHEETS["h100"].nvlink_bw, 5e-6), LinkSpec(100 * GB, 10e-6)),  # 8x100 Gb/s
    "h200": (LinkSpec(DATASHEETS["h200"].nvlink_bw, 5e-6), LinkSpec(100 * GB, 10e-6)),
    "cpu": (LinkSpec(5 * GB, 50e-6), LinkSpec(1 * GB, 100e-6)),  # gloo over shared memory / TCP
}


def _ddr(sockets: int, channels: int, mega_transfers: int) -> float:
    return sockets * channels * mega_transfers * 1e6 * 8


# Hosts: the cloud instance that holds eight such GPUs (its published vCPUs / 2 cores, memory,
# and the DRAM of its processors). The CPU "device" (mist.engine.run checks) is nominal.
HOSTS: dict[str, HostSpec] = {
    "l4": HostSpec("GCP g2-standard-96 (2x Xeon Cascade Lake)", 384 * GiB, 48, _ddr(2, 6, 2933)),
    "a10g": HostSpec("AWS g5.48xlarge (2x EPYC 7R32)", 768 * GiB, 96, _ddr(2, 8, 3200)),
    "v100": HostSpec("AWS p3dn.24xlarge (2x Xeon 8175M)", 768 * GiB, 48, _ddr(2, 6, 2666)),
    "a100-40gb": HostSpec("AWS p4d.24xlarge (2x Xeon 8275CL)", 1152 * GiB, 48, _ddr(2, 6, 2933)),
    "h100": HostSpec("AWS p5.48xlarge (2x EPYC 7R13)", 2048 * GiB, 96, _ddr(2, 8, 3200)),
    "h200": HostSpec("AWS p5e.48xlarge (2x EPYC 7R13)", 2048 * GiB, 96, _ddr(2, 8, 3200)),
    "cpu": HostSpec("this machine (nominal)", 16 * GiB, 2, 40 * GB),
}


def cluster(
    gpu: str, gpus: int, gpus_per_node: int = 8, host_memory: int | None = None, gpu_memory: int | None = None
) -> ClusterSpec:
    """A cluster of ``gpus`` GPUs of type ``gpu``, filled node by node; ``host_memory``: bytes of
    DRAM per node instead of the GPU type's usual host's; ``gpu_memory``: bytes each device may
    use instead of its data sheet's (a cap: mist.engine.run enforces it)."""
    if not isinstance(gpu, str) or gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(GPUS)}")
    if not positive_int(gpus):
        raise ValueError(f"need a whole number of GPUs >= 1, got {gpus!r}")
    if not positive_int(gpus_per_node):
        raise ValueError(f"GPUs per node must be a whole number >= 1, got {gpus_per_node!r}")
    for what, value in (("host memory", host_memory), ("device memory", gpu_memory)):
        if value is not None and not positive_int(value):
            raise ValueError(f"{what} must be a positive whole number of bytes, got {value!r}")
    per_node = min(gpus, gpus_per_node)
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs do not fill nodes of {gpus_per_node} evenly")
    host = HOSTS[gpu]
    if host_memory is not None:
        host = replace(host, memory=int(host_memory))
    device = GPUS[gpu]
    if gpu_memory is not None:
        if gpu != "cpu" and gpu_memory > device.memory:  # a cap, not more memory (cpu's is nominal)
            raise ValueError(
                f"device memory {gpu_memory / GiB:.1f} GiB is above the {gpu}'s {device.memory / GiB:.1f} GiB"
            )
        device = replace(device, memory=int(gpu_memory))
    intra, inter = _LINKS[gpu]
    return ClusterSpec(device, gpus // per_node, per_node, intra, inter, host)


def model(name: str, /, **overrides) -> ModelSpec:
    """A preset, with ``overrides`` of its fields (a plan's ``model_overrides``). ``name`` is
    positional only, so that an override named ``name`` is refused as no field, never a TypeError
    about the argument given twice."""
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(MODELS)}")
    fields = [f.name for f in dataclasses.fields(ModelSpec) if f.name != "name"]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    return MODELS[name].with_(**overrides) if overrides else MODELS[name]


def preset_overrides(spec: ModelSpec) -> dict:
    """The fields in which ``spec`` differs from the preset it is named after: what a plan file
    stores to name its model exactly (``model(spec.name, **preset_overrides(spec)) == spec``);
    empty for a model that is no preset."""
    preset = MODELS.get(spec.name)
    if preset is None:
        return {}
    return {
        f.name: getattr(spec, f.name)
        for f in dataclasses.fields(ModelSpec)
        if getattr(spec, f.name) != getattr(preset, f.name)
    }


@dataclass(frozen=True)
class GradAccumulation:
    """How a training engine adds each micro-batch's weight gradients into the accumulated ones:
    an elementwise, memory-bound add over the stage's gradients on the GPU's compute stream. Per
    parameter it reads the accumulated and the new gradient and writes the sum. Mist's own cost
    model prices this add; it is what a sum of per-op profiles misses (they time no accumulation).
    """

    engine: str
    bytes_per_param: float  # read accumulated + read new + write sum
    first_micro_batch: bool  # the first micro-batch adds too (into a zeroed buffer), or writes

    def adds_per_micro_batch(self, grad_accum: int, sharded: bool = False) -> float:
        """Adds per micro-batch, averaged over the iteration's ``grad_accum`` micro-batches.
        ``sharded``: gradients reduced as backward makes them (ZeRO-2/3 over more than one
        replica) have no persistent buffer: the first micro-batch's sums are kept as they are
        (mist.engine.run's ShardedMasterAdamW, FSDP2's sharded .grad) and only later ones add."""
        return 1.0 if self.first_micro_batch and not sharded else (grad_accum - 1) / grad_accum


# Half-precision gradients: 2 bytes each.
GRAD_ACCUMULATION = {
    # mist.engine.run: the gradients are views into one zeroed contiguous buffer (as megatron-core's
    # DDP), so autograd adds every micro-batch's gradient in place, the first one too.
    "megatron-core": GradAccumulation("megatron-core", 3 * 2, True),
    # Mist's runtime: a persistent 16-bit gradient buffer the first micro-batch writes and the
    # others add into (its cost model's (G-1)/G adds of the flattened parameters).
    "mist": GradAccumulation("mist", 3 * 2, False),
    # Megatron-LM's LocalDDP: a hook adds each micro-batch's 16-bit gradient into an fp32 main_grad
    # (read 4 + read 2 + write 4 bytes), every micro-batch.
    "megatron-lm": GradAccumulation("megatron-lm", 4 + 2 + 4, True),
}
