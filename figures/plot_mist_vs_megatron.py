"""Figures of the Mist comparison, made only from artifacts/mist_vs_megatron/{results,reference}/*.json.

python figures/plot_mist_vs_megatron.py [--reference]
python -m figures.plot_mist_vs_megatron [--reference]    (from the repository root)
"""

from __future__ import annotations

from pathlib import Path

# first: the headless backend and the import path
if __package__:  # python -m figures.<script> (from the repository root)
    from figures._common import draw, finish, load, parse_source, plt
else:  # python figures/<script>.py: its folder is on the path
    from _common import draw, finish, load, parse_source, plt

EXPERIMENT = "mist_vs_megatron"
PREDICTED = "; predicted by Mist's cost model"
SYSTEMS = {
    "mist": "Mist",
    "megatron_lm_target": "Megatron-LM's space searched (Mist's model)",
    "aceso": "Aceso-style",
    "zero3": "ZeRO-3",
}


# The comparison's model families and sizes (run.py's ARCHS and SIZES), sizes small to large
FAMILIES = ("gpt3", "llama", "falcon")
SIZES = ["1.3b", "2.7b", "7b", "13b", "22b"]
# Reference points written before results had "family" and "size" name their model only by the
# preset (the key's "model"). Their names are looked up whole in the names run.py composes from
# family and size, never split: a preset's name is a label, not a format to parse.
_PRESETS = {f"{family}-{size}": (family, size) for family in FAMILIES for size in SIZES}


def _family_size(p) -> tuple[str, str | None]:
    """The point's model family and size: its own fields, else (an older point) its preset's
    from the table above; a model in neither is its own family of unknown size."""
    r = p.result
    if isinstance(r, dict) and "family" in r and "size" in r:
        return r["family"], r["size"]
    return _PRESETS.get(p.key["model"], (p.key["model"], None))


def _order(p) -> tuple:
    """Families alphabetically (as the figures have always been drawn), each small to large;
    an unknown size after the known ones rather than no figure at all."""
    family, size = _family_size(p)
    return family, SIZES.index(size) if size in SIZES else len(SIZES), p.key["model"]


def plot_speedup() -> Path | None:
    data = load(EXPERIMENT, "comparison.json")
    if data is None:
        return None
    panels = sorted({(p.key["gpu"], p.key["flash"]) for p in data}, key=lambda x: (x[0], not x[1]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.6 * len(panels)), squeeze=False)
    width = 0.8 / len(SYSTEMS)
    for ax, (gpu, flash) in zip(axes[:, 0], panels, strict=True):
        cases = sorted(data.select(gpu=gpu, flash=flash), key=_order)
        for j, (system, label) in enumerate(SYSTEMS.items()):
            values = []
            for p in cases:
                r = p.result
                ok = "iteration_s" in r.get(system, {}) and "iteration_s" in r.get("megatron", {})
                values.append(r["megatron"]["iteration_s"] / r[system]["iteration_s"] if ok else 0.0)
            ax.bar(
                [i + (j - (len(SYSTEMS) - 1) / 2) * width for i in range(len(cases))],
                values,
                width,
                label=label,
            )
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(range(len(cases)), [p.key["model"] for p in cases], rotation=45, fontsize=7)
        ax.set_ylabel("speedup over Megatron-LM grid")
        attention = "FlashAttention" if flash else "no FlashAttention"
        note = "0: no plan fits; Megatron-LM builds no Falcon"
        ax.set_title(f"{gpu} cluster, {attention} ({note})", fontsize=10)
        ax.legend(fontsize=7, ncol=3)
    return finish(
        fig,
        "Mist vs Megatron-LM, Aceso-style and ZeRO-3",
        data,
        "mist_speedup.png",
        note=PREDICTED,
    )


def plot_tuning_time() -> Path | None:
    data = load(EXPERIMENT, "comparison.json")
    if data is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for system, label in {**SYSTEMS, "megatron": "Megatron-LM grid"}.items():
        pts = [
            (p.key["gpus"], p.result[system]["tuning_s"])
            for p in data
            if "tuning_s" in p.result.get(system, {})
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), label=label, s=14)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tuning time on this machine, s")
    ax.legend(fontsize=7)
    return finish(fig, "Tuning time per case", data, "mist_tuning_time.png")


def plot_ablation() -> Path | None:
    data = load(EXPERIMENT, "ablation.json")
    if data is None:
        return None
    cases = sorted(data, key=lambda p: (p.key["gpu"], *_order(p)))
    variants = cases[0].provenance["config"]["variants"]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(variants)
    for j, variant in enumerate(variants):
        values = []
        for p in cases:
            r = p.result
            values.append(r["megatron"] / r[variant] if r.get("megatron") and r.get(variant) else 0.0)
        ax.bar([i + (j - 1.5) * width for i in range(len(cases))], values, width, label=variant)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    labels = [f"{p.key['gpu']}/{p.key['model']}" for p in cases]
    ax.set_xticks(range(len(cases)), labels, rotation=45, fontsize=7)
    ax.set_ylabel("speedup over Megatron-LM grid")
    ax.legend(fontsize=7, ncol=4)
    return finish(fig, "Where Mist's gain comes from (GPT-3)", data, "mist_ablation.png", note=PREDICTED)


MEASURED_SYSTEMS = {
    "mist": "Mist",
    "megatron": "Megatron-LM grid",
    "megatron_lm_target": "Megatron-LM's space",
    "aceso": "Aceso-style",
    "zero3": "ZeRO-3",
    "mist_tempo": "Mist + Tempo",
}


def plot_measured() -> Path | None:
    """Each system's winner trained under the cap: the measured step (bar) and the predicted one
    (black tick) per case; a winner that ran out of memory, or was refused, is an X at the axis."""
    data = load(EXPERIMENT, "measured.json")
    if data is None:
        return None
    cases = sorted(data, key=lambda p: (p.key["model"], p.key["processes"]))
    fig, ax = plt.subplots(figsize=(9, 4))
    systems = {k: v for k, v in MEASURED_SYSTEMS.items() if any(k in p.result for p in cases)}
    width = 0.8 / len(systems)
    for j, (system, label) in enumerate(systems.items()):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(cases))]
        runs = [p.result.get(system, {}) for p in cases]
        bars = ax.bar(xs, [r.get("measured_step_s", 0.0) * 1e3 for r in runs], width, label=label)
        color = bars.patches[0].get_facecolor()
        for x, r, p in zip(xs, runs, cases, strict=True):
            if system not in p.result:  # a case this system did not plan
                continue
            if "measured_step_s" in r:
                ax.plot([x - width / 2, x + width / 2], [r["plan"]["iteration_s"] * 1e3] * 2, color="black")
            else:  # no plan fits, out of memory or refused: no time
                ax.plot([x], [0], marker="x", color=color, markersize=9, clip_on=False)
    ax.plot([], [], color="black", label="predicted")
    labels = [
        f"{p.key['model']} x{p.key['processes']}\ncap {p.result['cap_bytes'] / 2**20:.0f} MiB" for p in cases
    ]
    ax.set_xticks(range(len(cases)), labels, fontsize=8)
    ax.set_ylabel("step time, ms (lower is better)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=len(systems) // 2 + 1, loc="upper center")
    title = "Mist vs the baselines under a memory cap, trained by megatron-core"
    launches = "/".join(sorted({str(p.key["launches"]) for p in cases}))
    interleaved = all(p.key.get("launch_order") == "interleaved" for p in cases)  # older points were not
    note = f"; measured on this CPU (median of {launches}{' interleaved' * interleaved} launches), x: no time"
    return finish(fig, title, data, "mist_measured.png", note=note)


def plot_tempo() -> Path | None:
    """Mist with Tempo's layers over Mist without, per case (predicted; 0: no plan with Tempo)."""
    data = load(EXPERIMENT, "tempo.json")
    if data is None:
        return None
    cases = sorted(data, key=lambda p: (p.key["gpu"], p.key["flash"], *_order(p)))
    fig, ax = plt.subplots(figsize=(11, 4))
    gains = [p.result.get("gain", 0.0) for p in cases]
    changed = ["tab:blue" if p.result.get("changes") else "tab:gray" for p in cases]
    ax.bar(range(len(cases)), gains, color=changed)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    labels = [f"{p.key['gpu']}/{p.key['model']}/{'flash' if p.key['flash'] else 'unfused'}" for p in cases]
    ax.set_xticks(range(len(cases)), labels, rotation=60, fontsize=6)
    ax.set_ylabel("speedup of Mist with Tempo over Mist")
    ax.set_ylim(min(0.95, *gains), max(gains) * 1.02)
    ax.bar([], [], color="tab:blue", label="Tempo changed the plan")
    ax.bar([], [], color="tab:gray", label="the same plan")
    ax.legend(fontsize=7)
    note = PREDICTED + "; Tempo's extra backward work unpriced"
    return finish(fig, "What Tempo's layers buy Mist (GPT-3, Llama)", data, "mist_tempo.png", note=note)


if __name__ == "__main__":
    from measure.parallel import interrupted_in_one_line  # on the path once _common is in

    with interrupted_in_one_line():  # one line, what was written stays
        parse_source(__doc__)
        draw("mist_vs_megatron", [plot_speedup, plot_tuning_time, plot_ablation, plot_measured, plot_tempo])
