"""Figures of the CTA-pipelining evaluation, made only from artifacts/cta_mlp/{results,reference}/*.json.

python figures/plot_cta_mlp.py [--reference]
python -m figures.plot_cta_mlp [--reference]    (from the repository root)
"""

from __future__ import annotations

import functools
from pathlib import Path

# first: the headless backend and the import path
if __package__:  # python -m figures.<script> (from the repository root)
    from figures._common import draw, finish, load, parse_source, plt
else:  # python figures/<script>.py: its folder is on the path
    from _common import draw, finish, load, parse_source, plt

EXPERIMENT = "cta_mlp"
METHODS = {
    "back_to_back_s": "back-to-back",
    "microbatch_s": "best micro-batching",
    "tp_s": "tensor parallel",
    "cta_s": "CTA-pipelining",
    "cta_tp_s": "CTA + TP",
}
MODELLED = "; latency model (impl/ctapipe/sim.py)"


def _load(name: str):
    """(results, {(hardware, GPUs, rows): result}, GPUs, GPU counts, row counts) of a latency-model
    result file, or None."""
    data = load(EXPERIMENT, f"{name}.json")
    if data is None:
        return None
    points = {(p.key["hardware"], p.key["gpus"], p.key["rows"]): p.result for p in data}
    gpus = sorted({k[0] for k in points})
    ns = sorted({k[1] for k in points})
    ms = sorted({k[2] for k in points})
    return data, points, gpus, ns, ms


def plot_latency(name: str = "sim") -> Path | None:
    loaded = _load(name)
    if loaded is None:
        return None
    prov, points, gpus, ns, ms = loaded
    fig, axes = plt.subplots(len(gpus), len(ns), figsize=(4.2 * len(ns), 3.4 * len(gpus)), squeeze=False)
    for row, gpu in zip(axes, gpus, strict=True):
        for ax, n in zip(row, ns, strict=True):
            for key, label in METHODS.items():
                xs = [m for m in ms if key in points[gpu, n, m]]
                if xs:
                    ys = [points[gpu, n, m][key] * 1e3 for m in xs]
                    ax.plot(xs, ys, marker="o", markersize=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("M (rows)")
            ax.set_ylabel("latency (ms)")
            ax.set_title(f"{gpu}, {n} GPUs: chain of {n} GEMMs 8192x8192", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)  # the panel with every method
    title, out = "Chain-of-GEMMs latency per method", f"cta_latency{_suffix(name)}.png"
    return finish(fig, title, prov, out, note=MODELLED)


def plot_reduction(name: str = "sim") -> Path | None:
    loaded = _load(name)
    if loaded is None:
        return None
    prov, points, gpus, ns, ms = loaded
    fig, axes = plt.subplots(1, len(gpus), figsize=(5.5 * len(gpus), 3.8), squeeze=False)
    for ax, gpu in zip(axes[0], gpus, strict=True):
        for color, m in enumerate((ms[0], ms[len(ms) // 2], ms[-1])):  # one colour per M
            for key, style, label in (
                ("cta_vs_microbatch", "-", "vs best micro-batching"),
                ("cta_vs_tp", "--", "vs TP"),
            ):
                ax.plot(
                    ns,
                    [100 * points[gpu, n, m][key] for n in ns],
                    style,
                    marker="o",
                    color=f"C{color}",
                    label=f"M={m} {label}",
                )
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_xticks(ns)
        ax.set_xlabel("GPUs (= layers of the chain)")
        ax.set_ylabel("latency reduction of CTA-pipelining (%)")
        # the paper's numbers as artifacts/cta_mlp/claims.py's PAPER holds them (a figure script reads
        # result files only: it runs from a copy of figures/ and the results, importing no experiment)
        ax.set_title(f"{gpu} (paper, 2 GPUs: up to 31.8% vs micro-batching, 29.6% vs TP)", fontsize=8)
        ax.legend(fontsize=6, ncol=2)
        ax.grid(alpha=0.3)
    return finish(
        fig,
        "Latency reduction of CTA-pipelining vs the number of GPUs",
        prov,
        f"cta_reduction{_suffix(name)}.png",
        note=MODELLED,
    )


def _suffix(name: str) -> str:
    return "" if name == "sim" else "_" + name.removeprefix("sim_")


if __name__ == "__main__":
    from measure.parallel import interrupted_in_one_line  # on the path once _common is in

    with interrupted_in_one_line():  # one line, what was written stays
        parse_source(__doc__)
        draw(
            "cta_mlp",
            [
                functools.partial(f, n)
                for n in ("sim", "sim_measured")
                for f in (plot_latency, plot_reduction)
            ],
        )
