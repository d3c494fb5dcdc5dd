"""Figures of the Mist comparison, made only from artifacts/mist_vs_megatron/results/*.json.

python figures/plot_mist_vs_megatron.py
"""

from __future__ import annotations

from pathlib import Path

from _common import ROOT, finish, plt  # first: sets the headless backend and the import path

from measure.results import load_results

RESULTS = ROOT / "artifacts" / "mist_vs_megatron" / "results"
PREDICTED = "; predicted by Mist's cost model"
SYSTEMS = {"mist": "Mist", "aceso": "Aceso-style", "zero3": "ZeRO-3"}


def _cases(points: dict, gpu: str, flash: str = "flash") -> list[str]:
    keys = [k for k in points if k.startswith(gpu + "/") and k.endswith("/" + flash)]
    order = ["1.3b", "2.7b", "7b", "13b", "22b"]
    return sorted(
        keys, key=lambda k: (k.split("/")[1].split("-")[0], order.index(k.split("/")[1].split("-")[1]))
    )


def plot_speedup() -> Path | None:
    path = RESULTS / "comparison.json"
    if not path.exists():
        return None
    data = load_results(path)
    panels = sorted({(k.split("/")[0], k.split("/")[2]) for k in data["points"]})
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.6 * len(panels)), squeeze=False)
    width = 0.8 / len(SYSTEMS)
    for ax, (gpu, flash) in zip(axes[:, 0], panels, strict=True):
        keys = _cases(data["points"], gpu, flash)
        for j, (system, label) in enumerate(SYSTEMS.items()):
            values = []
            for k in keys:
                r = data["points"][k]
                ok = "iteration_s" in r.get(system, {}) and "iteration_s" in r.get("megatron", {})
                values.append(r["megatron"]["iteration_s"] / r[system]["iteration_s"] if ok else 0.0)
            ax.bar([i + (j - 1) * width for i in range(len(keys))], values, width, label=label)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(range(len(keys)), [k.split("/")[1] for k in keys], rotation=45, fontsize=7)
        ax.set_ylabel("speedup over Megatron-LM grid")
        attention = "FlashAttention" if flash == "flash" else "no FlashAttention"
        ax.set_title(f"{gpu} cluster, {attention} (0: no plan fits)", fontsize=10)
        ax.legend(fontsize=7, ncol=3)
    return finish(
        fig,
        "Mist vs Megatron-LM, Aceso-style and ZeRO-3",
        data["provenance"],
        "mist_speedup.png",
        note=PREDICTED,
    )


def plot_tuning_time() -> Path | None:
    path = RESULTS / "comparison.json"
    if not path.exists():
        return None
    data = load_results(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for system, label in {**SYSTEMS, "megatron": "Megatron-LM grid"}.items():
        pts = [
            (r["gpus"], r[system]["tuning_s"])
            for r in data["points"].values()
            if "tuning_s" in r.get(system, {})
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), label=label, s=14)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tuning time on this machine, s")
    ax.legend(fontsize=7)
    return finish(fig, "Tuning time per case", data["provenance"], "mist_tuning_time.png")


def plot_ablation() -> Path | None:
    path = RESULTS / "ablation.json"
    if not path.exists():
        return None
    data = load_results(path)
    variants = data["provenance"]["config"]["variants"]
    keys = sorted(
        data["points"],
        key=lambda k: (k.split("/")[0], ["1.3b", "2.7b", "7b", "13b", "22b"].index(k.split("-")[-1])),
    )
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(variants)
    for j, variant in enumerate(variants):
        values = []
        for k in keys:
            r = data["points"][k]
            values.append(r["megatron"] / r[variant] if r.get("megatron") and r.get(variant) else 0.0)
        ax.bar([i + (j - 1.5) * width for i in range(len(keys))], values, width, label=variant)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(keys)), keys, rotation=45, fontsize=7)
    ax.set_ylabel("speedup over Megatron-LM grid")
    ax.legend(fontsize=7, ncol=4)
    return finish(
        fig, "Where Mist's gain comes from (GPT-3)", data["provenance"], "mist_ablation.png", note=PREDICTED
    )


if __name__ == "__main__":
    for made in (plot_speedup(), plot_tuning_time(), plot_ablation()):
        if made is not None:
            print(f"wrote {made}")
