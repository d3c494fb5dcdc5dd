"""What the planner plans for: the model, the GPU, the cluster. Presets for the Mist paper's cases.

Every size here is in elements or bytes, every rate in per-second units; one dataclass each is
the single source of shapes and hardware numbers for the whole planner. The presets are JSON files
in presets/, read on first use (then cached), never at import, through the strict checks of
``measure.presets``: models.json (the paper's sizes, the families' layer choices, the tiny shape;
``models()``), clusters.json (per GPU preset its links, its host, and the numbers of a device with
no data sheet; ``gpus()``, ``links()``, ``hosts()``) and the data sheets of
``measure.datasheets``. Add a preset by adding an entry to the file (``python -m mist list``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, replace
from pathlib import Path

from measure.checks import real, whole
from measure.datasheets import DATASHEETS_FILE, datasheets
from measure.presets import MAX_PRESET_BYTES, check_fields, count, flag, load_preset, number, text
from measure.units import GiB

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


PRESETS = Path(__file__).parent / "presets"
MODELS_FILE = PRESETS / "models.json"
CLUSTERS_FILE = PRESETS / "clusters.json"

# A size's fields (models.json "sizes", "tiny") and the layer choices a family may make
_SHAPE = ("hidden", "layers", "heads")
_CHOICES = ("vocab", "seq", "ffn", "kv_heads", "flash", "dropout", "norm", "gated_mlp", "positions")
_CHOICES += ("parallel_block", "tempo")


def _choice(path: Path | str, where: str, field: str, value: object) -> object:
    """One ModelSpec field of a preset, its type checked (its range: ModelSpec's own checks)."""
    if field in ("flash", "gated_mlp", "parallel_block", "tempo"):
        return flag(path, where, value)
    if field == "dropout":
        return number(path, where, value, most=1)  # below 1: ModelSpec's check
    if field == "norm" or field == "positions":
        allowed = NORMS if field == "norm" else POSITIONS
        if value not in allowed:
            raise ValueError(f"{path}: {where} must be one of {', '.join(allowed)}, got {value!r:.40}")
        return value
    return count(path, where, value, most=MAX_MODEL_SIZES.get(field, MAX_MODEL_SIZES["hidden"]))


def _fields(path: Path | str, where: str, d: object, required: tuple, optional: tuple = ()) -> dict:
    """The mapping ``where``: exactly its fields, each of ModelSpec's type."""
    d = check_fields(path, where, d, required, optional)
    return {k: _choice(path, f"{where}.{k}", k, v) for k, v in d.items()}


def _spec(path: Path | str, name: str, **fields) -> ModelSpec:
    """The preset ``name``; what ModelSpec refuses (heads not dividing hidden) in one line naming the file."""
    try:
        return ModelSpec(name, **fields)
    except ValueError as e:
        raise ValueError(f"{path}: model {name}: {e}") from None


def read_models(path: Path) -> tuple[dict[str, dict], dict[str, ModelSpec]]:
    """The families' layer choices and the model presets in ``path`` (models.json's form), read
    strictly: the product of the sizes and the families (``<family>-<size>``, families first), then
    each family's tiny shape (``<family>-tiny``)."""
    d = load_preset(path)
    notes = ("sizes_source", "families_source", "tiny_source")
    check_fields(path, "", d, ("sizes", "families", "tiny", *notes))
    for key in notes:
        text(path, key, d[key])
    for key in ("sizes", "families"):
        if not isinstance(d[key], dict) or not d[key]:
            raise ValueError(
                f"{path}: {key} must be a non-empty mapping of names to fields, got {d[key]!r:.60}"
            )
    sizes = {
        text(path, "a size's name", k): _fields(path, f"sizes.{k}", v, _SHAPE) for k, v in d["sizes"].items()
    }
    families = {
        text(path, "a family's name", k): _fields(path, f"families.{k}", v, (), _CHOICES)
        for k, v in d["families"].items()
    }
    tiny = _fields(path, "tiny", d["tiny"], _SHAPE, _CHOICES)
    presets = {
        f"{family}-{size}": _spec(path, f"{family}-{size}", **shape, **choices)
        for family, choices in families.items()
        for size, shape in sizes.items()
    }
    # Tiny shapes that megatron-core trains on a CPU in seconds (mist.engine.run tests, CPU checks)
    presets.update(
        {
            f"{family}-tiny": _spec(path, f"{family}-tiny", **{**choices, **tiny})
            for family, choices in families.items()
        }
    )
    return families, presets


@functools.cache
def _model_presets() -> tuple[dict[str, dict], dict[str, ModelSpec]]:
    return read_models(MODELS_FILE)


def families() -> dict[str, dict]:
    """The model families' layer choices (the fields they set beyond the sizes), by name."""
    return _model_presets()[0]


def models() -> dict[str, ModelSpec]:
    """The model presets by name: the paper's sizes x the families, and each family's tiny shape."""
    return _model_presets()[1]


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


def _ddr(sockets: int, channels: int, mega_transfers: int) -> float:
    """Data-sheet DRAM bandwidth, bytes/s: sockets x channels x transfer rate x 8 bytes a transfer."""
    return sockets * channels * mega_transfers * 1e6 * 8


# The preset of a CPU as Mist's device: `mist profile --device cpu` calibrates it, and plans on it
# run on mist.engine.run's CPU engine (no CUDA context, gloo, its own interference and fit)
CPU_PRESET = "cpu"

# clusters.json's fields: per GPU preset its links and host, and a device's numbers where the GPU
# has no data sheet (the nominal "cpu")
_CLUSTER = ("intra", "inter", "host")
_LINK = ("bytes_per_s", "latency_s", "source")
_HOST = ("name", "memory_bytes", "cores", "source")
_DDR = ("sockets", "channels", "dram_mega_transfers_per_s")
_DEVICE = (
    "dense_bf16_flop_per_s",
    "fp32_flop_per_s",
    "memory_bytes",
    "hbm_bytes_per_s",
    "pcie_bytes_per_s",
    "l2_bytes",
    "source",
)
_NVLINK = "nvlink"  # an intra-node link's bytes_per_s: the data sheet's NVLink rate


def _link(path: Path | str, where: str, d: object, nvlink: float | None, intra: bool) -> LinkSpec:
    """A link: its bus bandwidth per GPU (bytes/s; within a node, "nvlink": the data sheet's, where
    ``nvlink`` is given) and latency."""
    check_fields(path, where, d, _LINK)
    text(path, f"{where}.source", d["source"])
    bw = d["bytes_per_s"]
    if bw == _NVLINK and nvlink is not None:
        bw = nvlink
    else:
        also = ' (or "nvlink": the data sheet\'s, where it has one)' if intra else ""
        bw = number(path, f"{where}.bytes_per_s", bw, above=True, or_else=also)
    return LinkSpec(bw, number(path, f"{where}.latency_s", d["latency_s"]))


def _host(path: Path | str, where: str, d: object) -> HostSpec:
    """A node's host: DRAM bandwidth given as dram_bytes_per_s or as the sockets, channels and
    transfer rate it is computed from (the data sheet's peak), one or the other."""
    check_fields(path, where, d, _HOST, ("dram_bytes_per_s", *_DDR))
    text(path, f"{where}.source", d["source"])
    given = "dram_bytes_per_s" in d
    if given == any(k in d for k in _DDR) or not (given or all(k in d for k in _DDR)):
        raise ValueError(
            f"{path}: {where}: give dram_bytes_per_s or all of {', '.join(_DDR)}, one or the other"
        )
    if given:
        mem_bw = number(path, f"{where}.dram_bytes_per_s", d["dram_bytes_per_s"], above=True)
    else:
        mem_bw = _ddr(*(count(path, f"{where}.{k}", d[k]) for k in _DDR))
    return HostSpec(
        text(path, f"{where}.name", d["name"]),
        count(path, f"{where}.memory_bytes", d["memory_bytes"], most=MAX_PRESET_BYTES),
        count(path, f"{where}.cores", d["cores"]),
        mem_bw,
    )


def _device(path: Path | str, name: str, d: object) -> GpuSpec:
    """A device with no data sheet, its numbers in clusters.json."""
    where = f"{name}.device"
    check_fields(path, where, d, _DEVICE)
    text(path, f"{where}.source", d["source"])
    fp32 = d["fp32_flop_per_s"]
    return GpuSpec(
        name,
        number(path, f"{where}.dense_bf16_flop_per_s", d["dense_bf16_flop_per_s"], above=True),
        count(path, f"{where}.memory_bytes", d["memory_bytes"], most=MAX_PRESET_BYTES),
        number(path, f"{where}.hbm_bytes_per_s", d["hbm_bytes_per_s"], above=True),
        number(path, f"{where}.pcie_bytes_per_s", d["pcie_bytes_per_s"], above=True),
        count(path, f"{where}.l2_bytes", d["l2_bytes"], least=0, most=MAX_PRESET_BYTES),
        None
        if fp32 is None
        else number(path, f"{where}.fp32_flop_per_s", fp32, above=True, or_else=" (or null)"),
    )


def read_clusters(
    path: Path, sheets: dict | None = None
) -> tuple[dict[str, GpuSpec], dict[str, tuple[LinkSpec, LinkSpec]], dict[str, HostSpec]]:
    """The GPU presets in ``path`` (clusters.json's form), read strictly: (GPUs, links, hosts) by
    name. A GPU's numbers are its data sheet's (``sheets``; default the shipped ones), or the
    entry's ``device`` where it has none."""
    sheets = datasheets() if sheets is None else sheets
    d = load_preset(path)
    if not d:
        raise ValueError(f"{path}: no GPU preset (a mapping of GPU names to their links and host)")
    devices, node_links, node_hosts = {}, {}, {}
    for name, entry in d.items():
        text(path, "a GPU's name", name)
        check_fields(path, name, entry, _CLUSTER, ("device",))
        sheet = sheets.get(name)
        if "device" in entry:
            if sheet is not None:
                raise ValueError(
                    f"{path}: {name}.device: {name} has a data sheet in {DATASHEETS_FILE.name}; "
                    "a device's numbers are given here only for a GPU with none"
                )
            devices[name] = _device(path, name, entry["device"])
        else:
            needed = ("memory", "hbm_bw", "pcie_bw", "l2")
            if sheet is None or any(getattr(sheet, k) is None for k in needed):
                raise ValueError(
                    f"{path}: {name}: no data sheet with memory, HBM, PCIe and L2 in "
                    f"{DATASHEETS_FILE.name} (or a device field here with its numbers)"
                )
            devices[name] = GpuSpec(
                name, sheet.flops, sheet.memory, sheet.hbm_bw, sheet.pcie_bw, sheet.l2, sheet.fp32_flops
            )
        nvlink = None if sheet is None else sheet.nvlink_bw
        node_links[name] = (
            _link(path, f"{name}.intra", entry["intra"], nvlink, intra=True),
            _link(path, f"{name}.inter", entry["inter"], None, intra=False),
        )
        node_hosts[name] = _host(path, f"{name}.host", entry["host"])
    return devices, node_links, node_hosts


@functools.cache
def _cluster_presets() -> tuple[
    dict[str, GpuSpec], dict[str, tuple[LinkSpec, LinkSpec]], dict[str, HostSpec]
]:
    return read_clusters(CLUSTERS_FILE)


def gpus() -> dict[str, GpuSpec]:
    """The GPU presets by name: each's data sheet (measure.datasheets), or its device numbers in
    clusters.json (the CPU "device" of mist.engine.run checks: nominal rates; use `mist profile`)."""
    return _cluster_presets()[0]


def links() -> dict[str, tuple[LinkSpec, LinkSpec]]:
    """Per GPU preset its (intra-node, inter-node) links: NVLink bus bandwidth per GPU, or PCIe
    where a GPU has no NVLink; between nodes the NICs'."""
    return _cluster_presets()[1]


def hosts() -> dict[str, HostSpec]:
    """Per GPU preset its node's host: the cloud instance that holds eight such GPUs."""
    return _cluster_presets()[2]


def cluster(
    gpu: str, gpus: int, gpus_per_node: int = 8, host_memory: int | None = None, gpu_memory: int | None = None
) -> ClusterSpec:
    """A cluster of ``gpus`` GPUs of type ``gpu``, filled node by node; ``host_memory``: bytes of
    DRAM per node instead of the GPU type's usual host's; ``gpu_memory``: bytes each device may
    use instead of its data sheet's (a cap: mist.engine.run enforces it)."""
    devices, node_links, node_hosts = _cluster_presets()  # (``gpus`` here is the count)
    if not isinstance(gpu, str) or gpu not in devices:
        raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(devices)}")
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
    host = node_hosts[gpu]
    if host_memory is not None:
        host = replace(host, memory=int(host_memory))
    device = devices[gpu]
    if gpu_memory is not None:
        if gpu != CPU_PRESET and gpu_memory > device.memory:  # a cap, not more memory (cpu's is nominal)
            raise ValueError(
                f"device memory {gpu_memory / GiB:.1f} GiB is above the {gpu}'s {device.memory / GiB:.1f} GiB"
            )
        device = replace(device, memory=int(gpu_memory))
    intra, inter = node_links[gpu]
    return ClusterSpec(device, gpus // per_node, per_node, intra, inter, host)


def model(name: str, /, **overrides) -> ModelSpec:
    """A preset, with ``overrides`` of its fields (a plan's ``model_overrides``). ``name`` is
    positional only, so that an override named ``name`` is refused as no field, never a TypeError
    about the argument given twice."""
    if not isinstance(name, str) or name not in models():
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(models())}")
    fields = [f.name for f in dataclasses.fields(ModelSpec) if f.name != "name"]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    preset = models()[name]
    return preset.with_(**overrides) if overrides else preset


def preset_overrides(spec: ModelSpec) -> dict:
    """The fields in which ``spec`` differs from the preset it is named after: what a plan file
    stores to name its model exactly (``model(spec.name, **preset_overrides(spec)) == spec``);
    empty for a model that is no preset. A new dict each call (a plan keeps it)."""
    global _last_overrides
    last, fields = _last_overrides
    # An exhaustive search makes a plan per point of its space (10^5 for the largest), each
    # naming the one spec: its fields are found once. Keyed by identity, not equality: equal
    # specs may hold values of other types (numpy's int64 against int), which a plan keeps.
    if spec is not last:
        fields = _overridden_fields(spec)
        _last_overrides = (spec, fields)
    return dict(fields)


_last_overrides: tuple[ModelSpec | None, tuple] = (None, ())  # preset_overrides' last spec


def _overridden_fields(spec: ModelSpec) -> tuple[tuple[str, object], ...]:
    preset = models().get(spec.name)
    if preset is None:
        return ()
    return tuple(
        (f.name, getattr(spec, f.name))
        for f in dataclasses.fields(ModelSpec)
        if getattr(spec, f.name) != getattr(preset, f.name)
    )


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
    # bytes an accumulated gradient takes, a parameter: the device memory it holds, what clipping's
    # norm reads, and whether the step needs an fp32 copy of it (under 4)
    grad_bytes: int = 2
    # bytes a parameter's gradient sends in each DP reduction: the sum after backward (ZeRO-0/1)
    # and ZeRO-2/3's reduce-scatters in backward
    reduce_bytes: int = 2
    # device bytes a parameter of an unsharded (ZeRO-0) stage keeps beyond the 16 priced (16-bit
    # weights and gradients, fp32 master and Adam moments): over one replica, over several
    replicated_extra_bytes: tuple[float, float] = (0.0, 0.0)
    # device bytes a parameter of a ZeRO-1 stage keeps beyond the same 16 (sharded optimizer,
    # whole gradients)
    zero1_extra_bytes: float = 0.0
    # the ZeRO stage from which the engine shards gradients as FSDP2 does, each module's backward
    # ending with its 16-bit gradients and their reduce-scatter input in the reduce dtype both
    # held; None: mist.engine.run's own ZeRO-3 (stage_cost._sharded_grads_end_bytes)
    fsdp2_from_zero: int | None = None

    def adds_per_micro_batch(self, grad_accum: int, sharded: bool = False) -> float:
        """Adds per micro-batch, averaged over the iteration's ``grad_accum`` micro-batches.
        ``sharded``: gradients reduced as backward makes them (ZeRO-2/3 over more than one
        replica) have no persistent buffer: the first micro-batch's sums are kept as they are
        (mist.engine.run's ShardedMasterAdamW, FSDP2's sharded .grad) and only later ones add."""
        return 1.0 if self.first_micro_batch and not sharded else (grad_accum - 1) / grad_accum


# Half-precision gradients, 2 bytes each, unless an engine's entry says otherwise (mist export
# passes Megatron-LM --grad-reduce-in-bf16 for them; Plan.priced_engine).
GRAD_ACCUMULATION = {
    # mist.engine.run: the gradients are views into one zeroed contiguous buffer (as megatron-core's
    # DDP), so autograd adds every micro-batch's gradient in place, the first one too.
    "megatron-core": GradAccumulation("megatron-core", 3 * 2, True),
    # Mist's runtime: a persistent 16-bit gradient buffer the first micro-batch writes and the
    # others add into (its cost model's (G-1)/G adds of the flattened parameters).
    "mist": GradAccumulation("mist", 3 * 2, False),
    # Megatron-LM at its bf16 default (accumulate_allreduce_grads_in_fp32): a hook adds each
    # micro-batch's 16-bit gradient into an fp32 main_grad (read 4 + read 2 + write 4 bytes), every
    # micro-batch, and DP sums the fp32 main_grads.
    "megatron-lm": GradAccumulation("megatron-lm", 4 + 2 + 4, True, grad_bytes=4, reduce_bytes=4),
    # torchtitan (0.2.2) reduces in fp32: FSDP2's reduce_dtype (mixed_precision_reduce takes only
    # float32), DDP's all-reduce of the fp32 gradients autocast leaves. FSDP2's fp32 shards of
    # weights, gradients and Adam moments, 16 bytes a parameter, are priced as the others' 16-bit
    # weights and gradients and fp32 master and moments (2 + 2 + 12). Unsharded, it trains under
    # autocast: fp32 weights (4), their bf16 copies autograd keeps for backward (2), fp32
    # gradients (4), Adam's moments (8): 18 bytes, 2 more; DDP (replicate, no bucket views) copies
    # the gradients into its buckets, 4 more. Its ZeRO-1 is FSDP2 in a pipeline: torch's pipeline
    # stages (torch.distributed.pipelining) turn FSDP's gradient sync off for every micro-batch
    # and reduce-scatter once after the last one's backward, so a stage keeps its gathered 16-bit
    # weights and its whole gradients, accumulated in fp32 (FSDP2's reduce dtype): 2 bytes more.
    # Each micro-batch but the first adds its fp32 gradients (the first's are kept as autograd
    # or the reduce-scatter made them).
    "torchtitan": GradAccumulation(
        "torchtitan",
        3 * 4,
        False,
        reduce_bytes=4,
        replicated_extra_bytes=(2.0, 6.0),
        zero1_extra_bytes=2.0,
        fsdp2_from_zero=2,  # its ZeRO-2 is FSDP2 without resharding
    ),
}

# the engines (GRAD_ACCUMULATION's) each trainer runs gradients as, its default first: Megatron-LM
# at 16 bits (mist export's --grad-reduce-in-bf16) or its bf16 default's fp32 main grads;
# torchtitan its own
TARGET_ENGINES = {"megatron-lm": ("megatron-core", "megatron-lm"), "torchtitan": ("torchtitan",)}


def check_grad_accumulation(value: object) -> GradAccumulation:
    """``value`` if it is one of GRAD_ACCUMULATION's engines (a priced plan records its engine by
    name, Plan.priced_engine); else ValueError, in one line."""
    if not any(value == known for known in GRAD_ACCUMULATION.values()):
        raise ValueError(
            f"grad_accumulation must be one of mist.model.specs.GRAD_ACCUMULATION's engines "
            f"({', '.join(GRAD_ACCUMULATION)}), got {value!r:.80}"
        )
    return value
