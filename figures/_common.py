"""What every figure script shares: which results it draws (this machine's, or the committed
reference), where the figure goes, and a title that says where its numbers came from.

    python figures/plot_<exp>.py               this machine's results -> figures/results/ (git-ignored)
    python figures/plot_<exp>.py --reference   committed reference    -> figures/reference/ (committed)

(or ``python -m figures.plot_<exp>`` from the repository root)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "impl"))  # measure.results without installing the package
sys.path.insert(0, str(ROOT))

from artifacts.verdicts import check_values  # noqa: E402
from measure.cli import OneLineParser  # noqa: E402
from measure.results import ResultFileError, Results, atomic_path  # noqa: E402

_SOURCE = {"reference": False}


def parse_source(description: str) -> None:
    """Read --reference from the command line (once, in each script's main)."""
    ap = OneLineParser(description=description)
    ap.add_argument("--reference", action="store_true", help="draw the committed reference results")
    _SOURCE["reference"] = ap.parse_args().reference


def source_name() -> str:
    return "reference" if _SOURCE["reference"] else "results"


def load(experiment: str, name: str) -> Results | None:
    """The result file ``name`` of ``experiment`` from the chosen source; None if it has no points.
    Its numbers are checked as the claims check them (``verdicts.check_values``): finite, and in
    their kind's range (a latency of -1 or NaN was drawn around, dropped from a log axis)."""
    try:
        found = Results.load(ROOT / "artifacts" / experiment / source_name() / name)
        check_values(found)  # as the claims read it: a NaN or a negative time is not drawn around
    except ResultFileError as e:  # names the file and what to do
        raise SystemExit(f"error: {e}") from None
    return found if len(found) else None


def draw(experiment: str, plots: list[Callable[[], Path | None]]) -> None:
    """Each of ``plots`` (a figure's path, or None where its results are missing), saying what
    was written, or in one line that there was nothing to draw or that a point could not be."""
    made = []
    for plot in plots:
        try:
            made.append(plot())
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a point of another shape
            raise SystemExit(
                f"error: artifacts/{experiment}/{source_name()}/ holds a point this script cannot draw "
                f"({type(e).__name__}: {e}); rerun the experiment (nox -s {experiment}) into it"
            ) from None
    for path in filter(None, made):
        print(f"wrote {path}")
    if not any(made):
        instead = "" if _SOURCE["reference"] else ", or draw the committed reference with --reference"
        print(
            f"nothing to draw: artifacts/{experiment}/{source_name()}/ has no results; run nox -s "
            f"{experiment} first{instead}"
        )


def source_note(results: Results) -> str:
    """Which results, from which commits, devices and dates (each point carries its own)."""
    provs = [p.provenance for p in results]
    commits = sorted(
        {(p["git"]["commit"] or "?")[:10] + ("+dirty" if p["git"]["dirty"] else "") for p in provs}
    )
    devices = sorted({p["device"].get("gpu") or p["device"]["device"] for p in provs})
    dates = sorted(p["finished_utc"][:10] for p in provs)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    which = "reference results" if _SOURCE["reference"] else "this machine's results"
    return f"{which}: {', '.join(commits)} on {', '.join(devices)}, {when}"


def finish(fig, title: str, results: Results, name: str, rect=(0, 0, 1, 1), note: str = "") -> Path:
    """Title with the results' provenance, tight layout, save under figures/<source>/ (whole or
    not at all), close."""
    fig.suptitle(f"{title}\n{source_note(results)}{note}", fontsize=9)
    fig.tight_layout(rect=rect)
    out = Path(__file__).parent / source_name() / name
    out.parent.mkdir(exist_ok=True)
    # beside it, then renamed: a kill mid-save left a committed reference figure truncated
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=130, format=out.suffix.removeprefix("."))
    plt.close(fig)
    return out


def compile_panel(ax, rows: dict[str, dict], bytes_field: str, base: str, title: str) -> None:
    """One panel of a torch.compile comparison: bytes kept (bars, MiB) per variant of ``rows``
    (variant -> result), and each one's training step over ``base``'s (dots, right axis)."""
    names = list(rows)
    mib = [rows[n][bytes_field] / 2**20 for n in names]
    ratios = [rows[n]["step_s"] / rows[base]["step_s"] for n in names]
    ax.bar(names, mib, color="tab:blue", label="kept for backward, MiB")
    ax.set_ylim(0, 1.4 * max(mib))  # room above for the legend
    ax.set_ylabel("kept for backward, MiB")
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    twin = ax.twinx()
    twin.plot(names, ratios, "o", color="tab:red", label=f"step time / {base}'s (right)")
    twin.axhline(1.0, color="tab:red", lw=0.5, ls=":")
    twin.set_ylabel(f"training step / {base}'s")
    twin.set_ylim(0, 1.4 * max(ratios))
    ax.set_title(title, fontsize=9)
    handles = [*ax.get_legend_handles_labels()[0], *twin.get_legend_handles_labels()[0]]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=6, loc="upper right")
