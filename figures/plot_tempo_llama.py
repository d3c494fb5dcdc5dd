"""Figures of Tempo on Llama-family decoders, made only from artifacts/tempo_llama/{results,reference}/*.json.

python figures/plot_tempo_llama.py [--reference]
python -m figures.plot_tempo_llama [--reference]    (from the repository root)
"""

from __future__ import annotations

from pathlib import Path

# first: the headless backend and the import path
if __package__:  # python -m figures.<script> (from the repository root)
    from figures._common import compile_panel, draw, finish, load, parse_source, plt
else:  # python figures/<script>.py: its folder is on the path
    from _common import compile_panel, draw, finish, load, parse_source, plt

EXPERIMENT = "tempo_llama"
MODELS = ("llama-3.2-1b", "llama-3-8b")
ORDER = [
    "hf-eager",
    "hf-sdpa",
    "checkpointing+sdpa",
    "tempo-rmsnorm",
    "tempo-swiglu",
    "tempo+sdpa",
    "tempo+sdpa+loss",
    "hf-sdpa+compile",  # max batch only: the eager step keeping what torch.compile keeps
    "tempo+sdpa+compile",
]


def plot_layer() -> Path | None:
    """Per layer (bars) and per sequence (the head and loss included; dots) at batch 1."""
    data = load(EXPERIMENT, "layer_saved_bytes.json")
    if data is None:
        return None
    models = [m for m in MODELS if data.select(model=m)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        found = {p.key["configuration"]: p.result for p in data.select(model=model)}
        names = [c for c in ORDER if c in found]
        layer = [found[c]["per_layer_bytes"] / 2**20 for c in names]
        seq = [found[c]["per_model_bytes"] / 2**30 for c in names]
        ax.bar(names, layer, color="tab:blue", label="one decoder layer (MiB, left)")
        for i, c in enumerate(names):
            ok = "=" if found[c]["formula_error"] < 1e-3 else "≠"
            ax.text(i, layer[i], f"{ok} formula", ha="center", va="bottom", fontsize=6)
        ax.set_ylabel("kept for backward per layer, MiB")
        ax.tick_params(axis="x", rotation=70, labelsize=7)
        twin = ax.twinx()
        twin.plot(names, seq, "o", color="tab:red", label="whole model per sequence (GiB, right)")
        twin.set_ylabel("whole model per sequence, GiB")
        twin.set_ylim(0, max(seq) * 1.15)
        ax.set_title(f"{model}, seq {data.select(model=model)[0].key['seq']}, bf16, batch 1", fontsize=9)
    handles = [*axes[0][0].get_legend_handles_labels()[0], *twin.get_legend_handles_labels()[0]]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=2, fontsize=7)
    title = "Bytes kept for backward: HF vs Tempo on Llama-family decoders (exact, fake tensors)"
    return finish(fig, title, data, "tempo_llama_layer.png", rect=(0, 0.06, 1, 1))


def plot_maxbatch() -> Path | None:
    data = load(EXPERIMENT, "max_batch.json")
    if data is None:
        return None
    gpus = list(next(iter(data)).provenance["config"]["gpus"])  # the result's other keys are not GPUs
    fitting = [p for p in data if any(p.result[g]["max_batch"] for g in gpus)]
    cases = sorted({(p.key["model"], p.key["seq"]) for p in fitting})
    if not cases:
        return None
    fig, axes = plt.subplots(1, len(cases), figsize=(3.6 * len(cases), 4.0), squeeze=False)
    for ax, (model, seq) in zip(axes[0], cases, strict=True):
        found = {p.key["configuration"]: p.result for p in data.select(model=model, seq=seq)}
        names = [c for c in ORDER if c in found]
        width = 0.8 / len(gpus)
        for j, gpu in enumerate(gpus):
            xs = [i + (j - (len(gpus) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [found[c][gpu]["max_batch"] for c in names], width, label=gpu)
        ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
        ax.set_title(f"{model}, seq {seq}", fontsize=9)
        ax.set_ylabel("max batch (sequences)")
        ax.legend(fontsize=7)
    title = (
        "Largest batch per GPU, AdamW step, bf16 + fp32 master weights (estimated; 0.75 GiB + 5% reserve);\n"
        "+compile: the eager step keeping what torch.compile keeps"
    )
    return finish(fig, title, data, "tempo_llama_max_batch.png")


COMPILED = ("hf-sdpa", "hf-sdpa+compile", "hf-sdpa+compile-at-tempo", "tempo+sdpa", "tempo+sdpa+compile")


def plot_compile() -> Path | None:
    """One decoder layer against torch.compile (compile.json: fp32 on this CPU, with a step's time)."""
    data = load(EXPERIMENT, "compile.json")
    if data is None:
        return None
    cases = sorted({(p.key["model"], p.key["seq"], p.key["dtype"], p.key["batch"]) for p in data})
    # wide enough for the title over one panel
    fig, axes = plt.subplots(1, len(cases), figsize=(max(7.0, 4.6 * len(cases)), 4.6), squeeze=False)
    for ax, (model, seq, dtype, batch) in zip(axes[0], cases, strict=True):
        points = data.select(model=model, seq=seq, dtype=dtype, batch=batch)
        found = {p.key["configuration"]: p.result for p in points}
        rows = {c: found[c] for c in COMPILED if c in found}
        compile_panel(
            ax, rows, "per_layer_bytes", "tempo+sdpa", f"{model}, seq {seq}, {dtype}, batch {batch}"
        )
    title = "A Llama decoder layer: Tempo against torch.compile (bytes exact, one training step timed)"
    return finish(fig, title, data, "tempo_llama_compile.png")


if __name__ == "__main__":
    from measure.parallel import interrupted_in_one_line  # on the path once _common is in

    with interrupted_in_one_line():  # one line, what was written stays
        parse_source(__doc__)
        draw("tempo_llama", [plot_layer, plot_maxbatch, plot_compile])
