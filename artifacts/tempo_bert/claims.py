"""The claims of ``nox -s tempo_bert``: Tempo inside whole models (bytes a layer keeps, the largest
batch that fits), training the same model, and throughput at each one's largest batch.

The paper's numbers are from its abstract (Tempo, arXiv 2210.10246): "up to 2x higher batch
sizes and 16% higher training throughput over the state-of-the-art baseline" on BERT-Large
pre-training, "19% and 26% speedup" on GPT-2 and RoBERTa.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from measure.results import Results

from ..verdicts import (
    EXACT,
    AtLeast,
    AtMost,
    Bound,
    Missing,
    Near,
    Paper,
    PaperClaim,
    Pin,
    Shown,
    Source,
    one,
)
from .summary import (
    PAIRWISE_KEY,
    TEMPO_KEY,
    WELCH_T_KEY,
    WRONG_KEY,
    dropout_off_key,
    over_rounding_key,
    training_summary,
)

EXPERIMENT = "tempo_bert"
COMMAND = "nox -s tempo_bert"
GPU_CHECK = "nox -s gpu_check"
ABSTRACT = "Tempo, arXiv 2210.10246, abstract"
MAX_BATCH = dict(
    experiment=EXPERIMENT,
    file="max_batch.json",
    evidence="predicted",
    basis="the step's peak bytes counted on fake tensors (measure.memory.StepMemoryEstimator) "
    "against the GPU's capacity",
    command=COMMAND,
)
COMPILE_MAX_BATCH = dict(
    MAX_BATCH,
    basis="the eager step's peak bytes counted on fake tensors with its saved activations at "
    "what torch.compile's partition keeps, in the layers and elsewhere (measure.memory's "
    "kept_scale), against the GPU's capacity",
)
COMPILE_CHECK = dict(
    experiment=EXPERIMENT,
    file="compile_check.json",
    evidence="measured",
    basis="this CPU (allocator events of real steps)",
    command=COMMAND,
)
TRAINING = dict(
    experiment=EXPERIMENT, file="training.json", evidence="measured", basis="this CPU", command=COMMAND
)
THROUGHPUT_GPU = dict(
    experiment=EXPERIMENT,
    file="throughput_cuda.json",
    evidence="measured",
    basis="one GPU (the GPU check)",
    command=GPU_CHECK,
    gpu=True,
)
ACTIVATION = dict(
    experiment=EXPERIMENT,
    file="activation_memory.json",
    evidence="measured",
    basis="counted exactly by the saved-tensor hooks, the tensors kept as CUDA's kernels keep them "
    "(bool dropout masks), run on this CPU",
    command=COMMAND,
)
# the models the paper's batch claim covers, with the GPU each was sized for here
MAX_BATCH_CASES = (
    ("bert-large", 512, "V100-16GB"),
    ("roberta-large", 512, "V100-16GB"),
    ("gpt2-xl", 1024, "A100-80GB"),
)


def per_layer_ratio(model: str, seq: int, ours: str, base: str) -> Callable[[Results], float]:
    """Bytes a layer keeps inside the model, ``ours`` over ``base``."""

    def value(r: Results) -> float:
        mine = one(r, model=model, seq=seq, configuration=ours)["per_layer_bytes"]
        return mine / one(r, model=model, seq=seq, configuration=base)["per_layer_bytes"]

    return value


def per_layer_saving(model: str, seq: int, ours: str, base: str) -> Callable[[Results], float]:
    ratio = per_layer_ratio(model, seq, ours, base)
    return lambda r: 1 - ratio(r)


def batch_ratio(
    model: str, seq: int, ours: str, base: str, gpu: str, head: str = "pretraining", precision: str = "fp16"
) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        fields = {"model": model, "head": head, "seq": seq, "precision": precision}
        mine = one(r, **fields, configuration=ours)[gpu]["max_batch"]
        theirs = one(r, **fields, configuration=base)[gpu]["max_batch"]
        return mine / theirs if theirs else math.inf

    return value


def largest_batch_ratio(r: Results) -> float:
    """The paper's "up to": the largest Tempo / HF eager max-batch ratio over its three models."""
    return max(batch_ratio(model, seq, "tempo", "hf-eager", gpu)(r) for model, seq, gpu in MAX_BATCH_CASES)


def training(key: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        summary = training_summary(r)
        if key not in summary:
            raise Missing(key)
        return summary[key]

    return value


def throughput_gain(model: str, seq: int) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        found = {p.key["configuration"]: p.result for p in r.select(model=model, seq=seq)}
        if "tempo" not in found or "hf-eager" not in found:
            raise Missing(model)
        return found["tempo"]["seqs_per_s_at_max_batch"] / found["hf-eager"]["seqs_per_s_at_max_batch"] - 1

    return value


def _throughput(id_: str, model: str, seq: int, name: str, paper: str, value: float) -> PaperClaim:
    return PaperClaim(
        id=id_,
        system="Tempo",
        claim=f"its larger batch trains {name} faster",
        paper=Paper(paper, value, ABSTRACT),
        measure=f"sequences/s at each one's measured max batch, Tempo / HF eager - 1, {name} seq {seq}",
        source=Source(**THROUGHPUT_GPU),
        neutral=0.0,
        unit="%",
        value=throughput_gain(model, seq),
    )


# Why a float64 pair is held to 1e-9 while a float32 one is held to nothing: 150 Adam steps
# amplify a first rounding difference chaotically. The float32 gaps seen (BERT 3.8e-6 to 1.4e-3,
# GPT-2 up to 0.0135, Llama up to 1.4e-5) are at most 1.1e5 times float32's epsilon (2^-23). The
# same factor on float64's (2^-52) is 2.5e-11, 40x below the bound.
# Welch's t of the dropout runs' final losses may reach this: scipy.stats.t.ppf(0.9995, 9), the
# 0.1% two-sided critical value at the fewest degrees of freedom Welch's test has with 10 seeds each
DROPOUT_T = 4.78
FLOAT64_WHY = (
    "150 steps amplified float32's rounding (eps 1.2e-7) to at most 0.0135 (GPT-2; 1.1e5 x eps) in "
    "the runs seen; the same on float64's (2.2e-16) is 2.5e-11. A real difference in the math shows "
    "at float32's size or more"
)


CLAIMS = (
    PaperClaim(
        id="maxbatch",
        system="Tempo",
        claim="larger batches fit",
        paper=Paper("up to 2x higher batch sizes", 2.0, ABSTRACT),
        measure="the largest max-batch ratio, Tempo / HF eager, over BERT-Large and RoBERTa-large "
        "(seq 512, 16 GB) and GPT-2 XL (seq 1024, 80 GB); fp16 with fp32 AdamW",
        source=Source(**MAX_BATCH),
        neutral=1.0,
        unit="x",
        value=largest_batch_ratio,
    ),
    _throughput("throughput-bert-gpu", "bert-large", 512, "BERT-Large", "+16% (BERT-Large)", 0.16),
    _throughput("throughput-gpt2-gpu", "gpt2-medium", 1024, "GPT-2 medium", "+19% (GPT-2)", 0.19),
    _throughput("throughput-roberta-gpu", "roberta-large", 512, "RoBERTa-large", "+26% (RoBERTa)", 0.26),
    Bound(
        id="same-training-bert-fp64",
        system="Tempo",
        claim="trains the same model: dropout off, the same losses, up to rounding",
        measure="BERT (MLM + NSP), dropout off, weights, optimizer and loss in float64, 150 steps: max "
        "|loss difference| against HF eager",
        source=Source(**TRAINING),
        value=training(dropout_off_key("bert-mini", float64=True)),
        check=AtMost(1e-9),
        unit="e",
        why=FLOAT64_WHY,
    ),
    Bound(
        id="same-training-gpt2-fp64",
        system="Tempo",
        claim="...",
        measure="GPT-2 (LM), dropout off, weights, optimizer and loss in float64: max |loss difference|",
        source=Source(**TRAINING),
        unit="e",
        value=training(dropout_off_key("gpt2-mini", float64=True)),
        check=AtMost(1e-9),
        why=FLOAT64_WHY,
    ),
    Shown(
        id="same-training-bert",
        system="Tempo",
        claim="Tempo trains BERT as HF in float32 (shown, not judged: see same-training-gpt2)",
        measure="BERT, fp32, 150 steps: max |loss difference| against HF eager",
        source=Source(**TRAINING),
        value=training(dropout_off_key("bert-mini")),
        unit="e",
    ),
    Shown(
        id="same-training-gpt2",
        system="Tempo",
        claim="Tempo trains GPT-2 as HF in float32 (shown, not judged: 150 Adam steps amplify a first "
        "rounding difference "
        "chaotically, so no bound on it is principled; BERT's was 3.8e-6, 1.2e-4 and 1.4e-3 in three "
        "runs of the same math. The float64 pairs above are the judged checks)",
        measure="GPT-2, fp32: max |loss difference| against HF, over that of HF with each batch's rows "
        "reversed (the same sums in another order) against HF",
        source=Source(**TRAINING),
        unit="x",
        value=training(over_rounding_key("gpt2-mini")),
    ),
    Bound(
        id="same-training-dropout",
        system="Tempo",
        claim="...with dropout on (other masks, the same distribution)",
        measure="BERT, dropout 0.1, 10 dropout seeds each: last-50-step loss, |Tempo - baseline| over its "
        "standard error (Welch's t)",
        source=Source(**TRAINING),
        check=AtMost(DROPOUT_T),
        value=training(WELCH_T_KEY),
        why="the 0.1% two-sided critical value at 9 degrees of freedom, the fewest Welch's test has "
        "with 10 seeds each: a Tempo that trains as HF fails it at most once in 1,000 runs, one over "
        "~2.1 seed sds off fails it. Was a fixed 0.02 on the 90% interval's end (twice the ~0.01 sd "
        "of earlier runs), broken by chance when one HF seed ended 0.08 above the others (2026-12-05)",
    ),
    Bound(
        id="same-training-dropout-band",
        system="Tempo",
        claim="...",
        measure="the same runs: median pairwise mean |loss difference|, Tempo-baseline over "
        "baseline-baseline",
        source=Source(**TRAINING),
        check=AtMost(1.25),
        unit="x",
        value=training(PAIRWISE_KEY),
        why="equal in distribution gives 1.0; 1.25 allows the sampling spread of medians over 100 "
        "and 45 pairs",
    ),
    Bound(
        id="dropout-distribution",
        system="Tempo",
        claim="...dropout masks from a seed: the same distribution",
        measure="BERT encoder output over 400 dropout draws at fixed weights (initial, trained): |total "
        "variance ratio - 1|, Tempo vs HF",
        source=Source(**TRAINING),
        check=AtMost(0.01),
        unit="%",
        value=training(TEMPO_KEY),
        why="a drop rate off by 0.01 moves the variance ~2%; the null (HF against itself) is ~0.3%",
    ),
    Bound(
        id="dropout-distribution-control",
        system="Tempo",
        claim="...and the check can see a wrong rate",
        measure="negative control: HF at dropout 0.08 and 0.12 against 0.1, |variance ratio - 1|",
        source=Source(**TRAINING),
        check=AtLeast(0.1),
        unit="%",
        value=training(WRONG_KEY),
        why="a negative control: a rate 0.02 off must be caught, well beyond the 1% bound above",
    ),
    Shown(
        id="tempo-in-model-bert",
        system="Tempo",
        claim="bytes a layer keeps inside BERT-Large",
        measure="per layer inside the model, Tempo vs HF eager, seq 512 (saving)",
        source=Source(**ACTIVATION),
        value=per_layer_saving("bert-large", 512, "tempo", "hf-eager"),
        unit="%",
    ),
    Shown(
        id="tempo-in-model-gpt2",
        system="Tempo",
        claim="...inside GPT-2 XL",
        measure="the same, GPT-2 XL, seq 1024",
        source=Source(**ACTIVATION),
        value=per_layer_saving("gpt2-xl", 1024, "tempo", "hf-eager"),
        unit="%",
    ),
    Bound(
        id="tempo-vs-compile-in-model",
        system="Tempo",
        claim="beyond the paper: Tempo keeps less than torch.compile inside BERT-Large, in bf16",
        measure="per layer inside the model, seq 512: Tempo against HF eager as torch.compile partitions "
        "it (AOTAutograd's min-cut partitioner, inductor's decompositions, traced on fake tensors: "
        "measure.compiled): saving",
        source=Source(**ACTIVATION),
        value=per_layer_saving("bert-large", 512, "tempo", "hf-eager+compile"),
        check=AtLeast(0.35),
        unit="%",
        why="issue #27's target, as tempo-vs-compile on the float32 layer alone",
    ),
    Shown(
        id="tempo-vs-compile-in-model-gpt2",
        system="Tempo",
        claim="...inside GPT-2 XL",
        measure="the same, GPT-2 XL, seq 1024",
        source=Source(**ACTIVATION),
        value=per_layer_saving("gpt2-xl", 1024, "tempo", "hf-eager+compile"),
        unit="%",
    ),
    Shown(
        id="compile-in-model-saving",
        system="Tempo",
        claim="what torch.compile alone saves inside GPT-2 XL",
        measure="per layer, GPT-2 XL seq 1024, bf16: HF eager compiled against HF eager (saving)",
        source=Source(**ACTIVATION),
        value=per_layer_saving("gpt2-xl", 1024, "hf-eager+compile", "hf-eager"),
        unit="%",
    ),
    Bound(
        id="tempo-compile-composes-in-model",
        system="Tempo",
        claim="...and composes with it",
        measure="per layer inside BERT-Large, seq 512, bf16: Tempo compiled over Tempo (bytes)",
        source=Source(**ACTIVATION),
        value=per_layer_ratio("bert-large", 512, "tempo+compile", "tempo"),
        check=AtMost(1.0),
        unit="x",
        why="compiling must not undo what Tempo saves",
    ),
    Bound(
        id="tempo-vs-compile-max-batch",
        system="Tempo",
        claim="...and fits a batch at least as large as torch.compile's",
        measure="largest batch, BERT-Large seq 512, fp16 + fp32 Adam, 16 GB: Tempo over HF with eager "
        "attention under torch.compile (x)",
        source=Source(**COMPILE_MAX_BATCH),
        value=batch_ratio("bert-large", 512, "tempo", "hf-eager+compile", "V100-16GB"),
        check=AtLeast(1.0),
        unit="x",
        why="Tempo keeps at least 35% less per layer (tempo-vs-compile-in-model); a smaller batch "
        "would mean its step's other bytes outgrow that",
    ),
    Bound(
        id="compile-max-batch-check",
        system="Tempo",
        claim="...an estimate checked against compiled steps",
        measure="a compiled step's peak (torch.compile, inductor's CPU code; bert-l4h256 seq 256 batch "
        "8, fp32; HF eager and Tempo) estimated as above: worst |estimated / measured - 1|",
        source=Source(**COMPILE_CHECK),
        value=lambda r: max(abs(one(r, configuration=c)["compiled_error"]) for c in ("hf-eager", "tempo")),
        check=AtMost(0.02),
        unit="%",
        why="2% of the peak moves a max-batch answer by about one batch in fifty; the eager estimate "
        "alone is within 0.2% of real CPU steps (tests/measure/test_measure.py)",
    ),
    Shown(
        id="tempo-sdpa-in-model-bert",
        system="Tempo",
        claim="...composed with SDPA",
        measure="the same, Tempo + SDPA vs HF SDPA, BERT-Large seq 512",
        source=Source(**ACTIVATION),
        value=per_layer_saving("bert-large", 512, "tempo+sdpa", "hf-sdpa"),
        unit="%",
    ),
    Shown(
        id="throughput-cpu",
        system="Tempo",
        claim="throughput on a CPU (no memory wall: no gain expected)",
        measure="sequences/s at each one's max batch, 4-layer BERT (h 256, seq 256, fp32) under a stated "
        "512 MiB budget, Tempo / HF eager - 1",
        source=Source(**dict(TRAINING, file="throughput_cpu.json")),
        value=throughput_gain("bert-l4h256", 256),
        unit="%",
    ),
)

PINS = (
    *(
        Pin(
            id=f"maxbatch-{model}",
            experiment=EXPERIMENT,
            file="max_batch.json",
            near=Near(),
            unit="x",
            value=batch_ratio(model, seq, "tempo", "hf-eager", gpu),
        )
        for model, seq, gpu in MAX_BATCH_CASES
    ),
    Pin(
        id="maxbatch-sdpa",
        experiment=EXPERIMENT,
        file="max_batch.json",
        near=Near(),
        unit="x",
        value=batch_ratio("bert-large", 512, "tempo+sdpa", "hf-sdpa", "V100-16GB"),
    ),
    Pin(
        id="maxbatch-cli-example",
        experiment=EXPERIMENT,
        file="max_batch.json",
        near=Near(),
        unit="x",
        value=batch_ratio("bert-large", 384, "tempo", "hf-eager", "2080Ti-11GB", "qa", "fp32"),
    ),
    *(
        Pin(
            id=c.id,
            experiment=EXPERIMENT,
            file="activation_memory.json",
            value=c.value,
            near=EXACT,
            unit=c.unit,
        )
        for c in CLAIMS
        if c.source.file == "activation_memory.json"
    ),
)
