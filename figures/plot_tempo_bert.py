"""Figures of Tempo's evaluation, made only from artifacts/tempo_bert/results/*.json.

python figures/plot_tempo_bert.py
"""

from __future__ import annotations

from pathlib import Path

from _common import ROOT, finish, plt  # first: sets the headless backend and the import path

from measure.results import load_results

RESULTS = ROOT / "artifacts" / "tempo_bert" / "results"
MAIN = ["hf-eager", "hf-sdpa", "tempo", "tempo+sdpa", "checkpointing"]


COMPONENTS = {  # module class name -> component, first match wins
    "Attention": "attention core (Q, K, V, P)",
    "GELU": "GELU",
    "LayerNorm": "LayerNorm",
    "Linear": "Linear/Conv1D inputs",
    "Conv1D": "Linear/Conv1D inputs",
    "Dropout": "dropout",
}
COMPONENT_ORDER = [*dict.fromkeys(COMPONENTS.values()), "other (layer input, checkpoints)"]
CONFIG_ORDER = [*MAIN, "tempo-gelu", "tempo-layernorm", "tempo-attention", "tempo-dropout"]


def _component(module_type: str) -> str:
    return next((c for key, c in COMPONENTS.items() if key in module_type), COMPONENT_ORDER[-1])


def _component_bytes(point: dict, component: str) -> int:
    return sum(v for k, v in point["per_layer_by_module_type"].items() if _component(k) == component)


def plot_activation() -> Path | None:
    path = RESULTS / "activation_memory.json"
    if not path.exists():
        return None
    data = load_results(path)
    cases = sorted({tuple(k.split("/")[:2]) for k in data["points"]}, key=lambda c: (c[0], int(c[1][1:])))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.0 * len(cases), 4.8), squeeze=False)
    colors = dict(zip(COMPONENT_ORDER, plt.cm.tab10.colors, strict=False))
    for ax, (model, seq) in zip(axes[0], cases, strict=True):
        names = [c for c in CONFIG_ORDER if f"{model}/{seq}/{c}" in data["points"]]
        points = [data["points"][f"{model}/{seq}/{c}"] for c in names]
        bottom = [0.0] * len(names)
        for comp in COMPONENT_ORDER:
            vals = [max(_component_bytes(p, comp), 0) / 2**20 for p in points]
            ax.bar(names, vals, bottom=bottom, color=colors[comp], label=comp)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for i, p in enumerate(points):
            cf = p["closed_form_bytes"]
            label = f"{cf['sbh']:.1f}sbh" + (f"\n+{cf['as2b']:.0f}as²b" if cf["as2b"] > 0.01 else "")
            ax.text(i, bottom[i], label, ha="center", va="bottom", fontsize=5.5)
        ax.set_title(f"{model}, seq {seq[1:]}", fontsize=10)
        ax.set_ylabel("kept for backward per layer, MiB")
        ax.set_ylim(0, max(bottom) * 1.18)
        ax.tick_params(axis="x", rotation=70, labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(COMPONENT_ORDER), fontsize=7, frameon=False)
    title = (
        "Activation memory per layer inside the model (batch 1, bf16; exact bytes; dropout and SDPA "
        "as their CUDA kernels keep them)"
    )
    return finish(fig, title, data["provenance"], "tempo_bert_activation.png", rect=(0, 0.06, 1, 1))


def plot_maxbatch() -> Path | None:
    path = RESULTS / "max_batch.json"
    if not path.exists():
        return None
    data = load_results(path)
    gpu_mem = data["provenance"]["config"]["gpus"]  # name -> "16GB"; result files sort keys
    gpus = sorted(gpu_mem, key=lambda g: float(gpu_mem[g].lower().removesuffix("gb")))
    cases = sorted({tuple(k.split("/")[:3]) for k in data["points"]}, key=lambda c: (c[0], int(c[1][1:])))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.4 * len(cases), 4.4), squeeze=False)
    width = 0.8 / len(MAIN)
    for ax, (model, seq, prec) in zip(axes[0], cases, strict=True):
        for i, conf in enumerate(MAIN):
            r = data["points"].get(f"{model}/{seq}/{prec}/{conf}")
            if r is None:
                continue
            xs = [g + (i - len(MAIN) / 2 + 0.5) * width for g in range(len(gpus))]
            ax.bar(xs, [r[g]["max_batch"] for g in gpus], width, label=conf)
            for x, g in zip(xs, gpus, strict=True):
                if r[g]["max_batch"] == 0:  # invisible on a log axis: say it
                    ax.text(x, 1, "0", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(gpus)), [gpu_mem[g] for g in gpus])
        ax.set_yscale("log")
        ax.set_title(f"{model}, seq {seq[1:]}, {prec}", fontsize=10)
        ax.set_ylabel("largest batch that fits (estimated)")
        ax.legend(fontsize=7)
    title = "Max batch per GPU memory: fake-tensor estimate of a whole AdamW step (reserve 0.75 GiB + 5%)"
    return finish(fig, title, data["provenance"], "tempo_bert_max_batch.png")


def plot_training() -> Path | None:
    path = RESULTS / "training.json"
    if not path.exists():
        return None
    data = load_results(path)
    pts = data["points"]
    panels = [
        (
            "bert-mini (MLM + NSP), dropout off",
            ["bert-mini/hf-eager/p0.0/seed1", "bert-mini/tempo/p0.0/seed1"],
        ),
        ("gpt2-mini (LM), dropout off", ["gpt2-mini/hf-eager/p0.0/seed1", "gpt2-mini/tempo/p0.0/seed1"]),
        (
            "bert-mini, dropout 0.1",
            ["bert-mini/hf-eager/p0.1/seed1", "bert-mini/hf-eager/p0.1/seed2", "bert-mini/tempo/p0.1/seed1"],
        ),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        keys = [k for k in keys if k in pts]
        for k in keys:
            _, conf, _, seed = k.split("/")
            ax.plot(pts[k]["losses"], label=f"{conf} (dropout {seed})", linewidth=1)
        if len(keys) == 2:  # dropout off: show the difference too
            a, b = (pts[k]["losses"] for k in keys)
            diff = [abs(x - y) for x, y in zip(a, b, strict=True)]
            twin = ax.twinx()
            twin.semilogy([max(d, 1e-16) for d in diff], color="gray", linewidth=0.8)
            control = [f"{k}/fp64" for k in keys]
            if all(k in pts for k in control):  # the float64 control: rounding alone parts the fp32 runs
                a64, b64 = (pts[k]["losses"] for k in control)
                diff64 = [max(abs(x - y), 1e-16) for x, y in zip(a64, b64, strict=True)]
                twin.semilogy(diff64, color="black", linestyle="--", linewidth=0.8)
                twin.set_ylabel("|loss difference|: fp32 (gray), fp64 (black dashed)")
            else:
                twin.set_ylabel("|loss difference| (gray)")
            twin.axhline(1e-3, color="gray", linestyle=":", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    title = "Same training with and without Tempo (fp32, one seed for weights and data; offline corpus)"
    return finish(fig, title, data["provenance"], "tempo_bert_loss_curves.png")


def plot_throughput(device: str) -> Path | None:
    """Sequences/s against batch, one line per configuration; the marker is each one's maximum."""
    path = RESULTS / f"throughput_{device}.json"
    if not path.exists():
        return None
    data = load_results(path)
    cases = sorted({tuple(k.split("/")[:3]) for k in data["points"]}, key=lambda c: (c[0], int(c[1][1:])))
    fig, axes = plt.subplots(1, len(cases), figsize=(max(7.0, 4.6 * len(cases)), 4.6), squeeze=False)
    for ax, (model, seq, prec) in zip(axes[0], cases, strict=True):
        for conf in CONFIG_ORDER:
            r = data["points"].get(f"{model}/{seq}/{prec}/{conf}")
            if r is None or not r["seqs_per_s"]:
                continue
            batches = sorted(map(int, r["seqs_per_s"]))
            (line,) = ax.plot(batches, [r["seqs_per_s"][str(b)] for b in batches], marker=".", label=conf)
            ax.plot(
                r["max_batch"], r["seqs_per_s_at_max_batch"], "o", ms=8, mfc="none", color=line.get_color()
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, seq {seq[1:]}, {prec}", fontsize=10)
        ax.set_xlabel("batch size (circle: the configuration's maximum)")
        ax.set_ylabel("training throughput, sequences/s")
        ax.legend(fontsize=7)
    cfg = data["provenance"]["config"]
    budget = cfg["gpu"] + (
        " GPU (less the 0.75 GiB + 5% reserve)" if cfg["reserve"] else " of memory (stated budget)"
    )
    where = (
        "measured max batch, allocator capped" if device == "cuda" else "estimated max batch; no memory wall"
    )
    title = f"Throughput vs batch on {device}: AdamW steps under a {budget};\n{where}"
    return finish(fig, title, data["provenance"], f"tempo_bert_throughput_{device}.png")


if __name__ == "__main__":
    for made in (
        plot_activation(),
        plot_maxbatch(),
        plot_training(),
        plot_throughput("cpu"),
        plot_throughput("cuda"),
    ):
        if made is not None:
            print(f"wrote {made}")
