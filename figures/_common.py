"""What every figure script shares: where results and figures live, and how a figure is titled
with the provenance of the result file it came from and saved."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "impl"))  # measure.results without installing the package


def source_note(prov: dict) -> str:
    commit = (prov.get("git", {}).get("commit") or "?")[:10]
    device = prov.get("device", {}).get("device", "?")
    return f"from {commit} on {device}, {prov.get('date_utc', '')}"


def finish(fig, title: str, prov: dict, name: str, rect=(0, 0, 1, 1), note: str = "") -> Path:
    """Title with the results' provenance, tight layout, save under figures/, close."""
    fig.suptitle(f"{title}\n{source_note(prov)}{note}", fontsize=9)
    fig.tight_layout(rect=rect)
    out = OUT / name
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
