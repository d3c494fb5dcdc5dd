"""Figures of Tempo's evaluation, made only from artifacts/tempo_bert/{results,reference}/*.json.

python figures/plot_tempo_bert.py [--reference]
python -m figures.plot_tempo_bert [--reference]    (from the repository root)
"""

from __future__ import annotations

import functools
from pathlib import Path

# first: the headless backend and the import path
if __package__:  # python -m figures.<script> (from the repository root)
    from figures._common import draw, finish, load, parse_source, plt
else:  # python figures/<script>.py: its folder is on the path
    from _common import draw, finish, load, parse_source, plt

from artifacts.tempo_bert.summary import float64_loss  # after _common, which puts the root on the path

EXPERIMENT = "tempo_bert"
MAIN = ["hf-eager", "hf-sdpa", "tempo", "tempo+sdpa", "checkpointing"]


COMPONENTS = {  # module class name -> component, first match wins
    "Attention": "attention core (Q, K, V, P)",
    "GELU": "GELU",
    "LayerNorm": "LayerNorm",
    "Linear": "Linear/Conv1D inputs",
    "Conv1D": "Linear/Conv1D inputs",
    "Dropout": "dropout",
    # a torch.compile row's partitioned graph runs as one function: its bytes are the top module's
    "<top>": "torch.compile's graph (one function)",
}
COMPONENT_ORDER = [*dict.fromkeys(COMPONENTS.values()), "other (layer input, checkpoints)"]
COMPILED = ["hf-eager+compile", "tempo+compile", "hf-eager+compile-at-tempo"]
CONFIG_ORDER = [*MAIN, *COMPILED, "tempo-gelu", "tempo-layernorm", "tempo-attention", "tempo-dropout"]


def _component(module_type: str) -> str:
    return next((c for key, c in COMPONENTS.items() if key in module_type), COMPONENT_ORDER[-1])


def _component_bytes(point: dict, component: str) -> int:
    return sum(v for k, v in point["per_layer_by_module_type"].items() if _component(k) == component)


def plot_activation() -> Path | None:
    data = load(EXPERIMENT, "activation_memory.json")
    if data is None:
        return None
    cases = sorted({(p.key["model"], p.key["seq"]) for p in data})
    fig, axes = plt.subplots(1, len(cases), figsize=(4.0 * len(cases), 4.8), squeeze=False)
    colors = dict(zip(COMPONENT_ORDER, plt.cm.tab10.colors, strict=False))
    for ax, (model, seq) in zip(axes[0], cases, strict=True):
        found = {p.key["configuration"]: p.result for p in data.select(model=model, seq=seq)}
        names = [c for c in CONFIG_ORDER if c in found]
        points = [found[c] for c in names]
        bottom = [0.0] * len(names)
        for comp in COMPONENT_ORDER:
            vals = [max(_component_bytes(p, comp), 0) / 2**20 for p in points]
            ax.bar(names, vals, bottom=bottom, color=colors[comp], label=comp)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for i, p in enumerate(points):
            cf = p["closed_form_bytes"]
            label = f"{cf['sbh']:.1f}sbh" + (f"\n+{cf['as2b']:.0f}as²b" if cf["as2b"] > 0.01 else "")
            ax.text(i, bottom[i], label, ha="center", va="bottom", fontsize=5.5)
        ax.set_title(f"{model}, seq {seq}", fontsize=10)
        ax.set_ylabel("kept for backward per layer, MiB")
        ax.set_ylim(0, max(bottom) * 1.18)
        ax.tick_params(axis="x", rotation=70, labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(COMPONENT_ORDER), fontsize=7, frameon=False)
    title = (
        "Activation memory per layer inside the model (batch 1, bf16; exact bytes; dropout and SDPA "
        "as their CUDA kernels keep them)"
    )
    return finish(fig, title, data, "tempo_bert_activation.png", rect=(0, 0.06, 1, 1))


def plot_maxbatch() -> Path | None:
    data = load(EXPERIMENT, "max_batch.json")
    if data is None:
        return None
    first = next(iter(data))
    gpu_mem = first.provenance["config"]["gpus"]  # name -> "16GB", the tick labels
    # by the memory each GPU leaves usable, as the point holds it (result files sort keys)
    gpus = sorted(gpu_mem, key=lambda g: first.result[g]["usable_gib"])
    cases = sorted(
        {(p.key["model"], p.key["seq"], p.key["precision"]) for p in data.select(head="pretraining")}
    )
    fig, axes = plt.subplots(1, len(cases), figsize=(4.4 * len(cases), 4.4), squeeze=False)
    rows = [*MAIN, *COMPILED[:2]]  # below the default budget torch.compile has no max-batch estimate
    width = 0.8 / len(rows)
    for ax, (model, seq, prec) in zip(axes[0], cases, strict=True):
        for i, conf in enumerate(rows):
            point = data.one(model=model, head="pretraining", seq=seq, precision=prec, configuration=conf)
            if point is None:
                continue
            r = point.result
            xs = [g + (i - len(rows) / 2 + 0.5) * width for g in range(len(gpus))]
            ax.bar(
                xs, [r[g]["max_batch"] for g in gpus], width, label=conf, color=f"C{i}"
            )  # one colour a row
            for x, g in zip(xs, gpus, strict=True):
                if r[g]["max_batch"] == 0:  # invisible on a log axis: say it
                    ax.text(x, 1, "0", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(gpus)), [gpu_mem[g] for g in gpus])
        ax.set_yscale("log")
        ax.set_title(f"{model}, seq {seq}, {prec}", fontsize=10)
        ax.set_ylabel("largest batch that fits (estimated)")
        ax.legend(fontsize=7)
    title = (
        "Max batch per GPU memory: fake-tensor estimate of a whole AdamW step (reserve 0.75 GiB + 5%); "
        "+compile: the eager step keeping what torch.compile keeps"
    )
    return finish(fig, title, data, "tempo_bert_max_batch.png")


def plot_training() -> Path | None:
    data = load(EXPERIMENT, "training.json")
    if data is None:
        return None

    def losses(model, conf, dropout=0.0, seed=1, dtype="fp32", loss=None):
        # rows as given (not the rounding control); ``loss``: how a float64 run computed its loss
        p = data.one(
            model=model,
            configuration=conf,
            dropout=dropout,
            dropout_seed=seed,
            dtype=dtype,
            rows=None,
            loss=loss,
        )
        return None if p is None else p.result["losses"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, model, title in (
        (axes[0], "bert-mini", "bert-mini (MLM + NSP), dropout off"),
        (axes[1], "gpt2-mini", "gpt2-mini (LM), dropout off"),
    ):
        _plot_dropout_off(ax, model, title, losses)
    _plot_dropout_on(axes[2], data)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    title = (
        "Same training with and without Tempo (one seed for weights and data; offline corpus): fp32, "
        "and the judged float64 pair (dashed, its bound dotted)"
    )
    return finish(fig, title, data, "tempo_bert_loss_curves.png")


def _plot_dropout_off(ax, model: str, title: str, losses) -> None:
    """One model's fp32 loss curves without dropout, baseline and Tempo, with their per-step
    difference (and the float64 pair's) on a log axis beside; nothing where a run is missing.
    ``losses``: a run's losses by (model, configuration, ...) (None: not run)."""
    a, b = losses(model, "hf-eager"), losses(model, "tempo")
    if a is None or b is None:
        return
    ax.plot(a, label="hf-eager", linewidth=1)
    ax.plot(b, label="tempo", linewidth=1)
    twin = ax.twinx()
    twin.semilogy([max(abs(x - y), 1e-16) for x, y in zip(a, b, strict=True)], color="gray", linewidth=0.8)
    # the judged pair, as the claims judge it (a causal LM's loss computed in float64); never the
    # other float64 pair in its place (earlier runs with the model's own loss stay in the file)
    loss64 = float64_loss(model)
    a64, b64 = (losses(model, conf, dtype="fp64", loss=loss64) for conf in ("hf-eager", "tempo"))
    if a64 is not None and b64 is not None:  # the float64 control: rounding alone parts the fp32 runs
        diff64 = [max(abs(x - y), 1e-16) for x, y in zip(a64, b64, strict=True)]
        twin.semilogy(diff64, color="black", linestyle="--", linewidth=0.8)
        twin.set_ylabel("|loss difference|: fp32 (gray), fp64 (black dashed)")
    else:
        twin.set_ylabel("|loss difference| (gray)")
    twin.axhline(1e-9, color="black", linestyle=":", linewidth=0.8)  # the float64 pair's bound
    ax.set_title(title, fontsize=10)


def _plot_dropout_on(ax, data) -> None:
    """bert-mini with dropout 0.1: every seed of both configurations, each one's mean thick."""
    for conf, color in (("hf-eager", "C0"), ("tempo", "C1")):
        runs = [p.result["losses"] for p in data.select(model="bert-mini", configuration=conf, dropout=0.1)]
        for curve in runs:
            ax.plot(curve, color=color, linewidth=0.5, alpha=0.5)
        if runs:
            mean = [sum(v) / len(v) for v in zip(*runs, strict=True)]
            ax.plot(
                mean, color=color, linewidth=1.5, label=f"{conf}: {len(runs)} dropout seeds and their mean"
            )
    ax.set_title("bert-mini, dropout 0.1", fontsize=10)


def plot_throughput(device: str) -> Path | None:
    """Sequences/s against batch, one line per configuration; the marker is each one's maximum."""
    data = load(EXPERIMENT, f"throughput_{device}.json")
    if data is None:
        return None
    setups = sorted({(p.key["gpu"], p.key["reserve"]) for p in data})
    gpu, reserve = setups[-1]  # one budget per figure: the last (runs at other budgets stay in the file)
    cases = sorted(
        {(p.key["model"], p.key["seq"], p.key["precision"]) for p in data.select(gpu=gpu, reserve=reserve)}
    )
    fig, axes = plt.subplots(1, len(cases), figsize=(max(7.0, 4.6 * len(cases)), 4.6), squeeze=False)
    for ax, (model, seq, prec) in zip(axes[0], cases, strict=True):
        for conf in CONFIG_ORDER:
            found = data.one(
                model=model, seq=seq, precision=prec, configuration=conf, gpu=gpu, reserve=reserve
            )
            if found is None or not found.result["seqs_per_s"]:
                continue
            r = found.result
            batches = sorted(map(int, r["seqs_per_s"]))
            (line,) = ax.plot(batches, [r["seqs_per_s"][str(b)] for b in batches], marker=".", label=conf)
            ax.plot(
                r["max_batch"], r["seqs_per_s_at_max_batch"], "o", ms=8, mfc="none", color=line.get_color()
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, seq {seq}, {prec}", fontsize=10)
        ax.set_xlabel("batch size (circle: the configuration's maximum)")
        ax.set_ylabel("training throughput, sequences/s")
        ax.legend(fontsize=7)
    budget = gpu + (" GPU (less the 0.75 GiB + 5% reserve)" if reserve else " of memory (stated budget)")
    where = (
        "measured max batch, allocator capped" if device == "cuda" else "estimated max batch; no memory wall"
    )
    title = f"Throughput vs batch on {device}: AdamW steps under a {budget};\n{where}"
    return finish(fig, title, data, f"tempo_bert_throughput_{device}.png")


if __name__ == "__main__":
    from measure.parallel import interrupted_in_one_line  # on the path once _common is in

    with interrupted_in_one_line():  # one line, what was written stays
        parse_source(__doc__)
        draw(
            "tempo_bert",
            [
                plot_activation,
                plot_maxbatch,
                plot_training,
                functools.partial(plot_throughput, "cpu"),
                functools.partial(plot_throughput, "cuda"),
            ],
        )
