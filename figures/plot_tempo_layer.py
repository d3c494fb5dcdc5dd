"""Figures of one BERT-Large encoder layer against torch.compile, made only from
artifacts/tempo_layer/{results,reference}/*.json.

python figures/plot_tempo_layer.py [--reference]
python -m figures.plot_tempo_layer [--reference]    (from the repository root)
"""

from __future__ import annotations

from pathlib import Path

# first: the headless backend and the import path
if __package__:  # python -m figures.<script> (from the repository root)
    from figures._common import compile_panel, draw, finish, load, parse_source, plt
else:  # python figures/<script>.py: its folder is on the path
    from _common import compile_panel, draw, finish, load, parse_source, plt

EXPERIMENT = "tempo_layer"
ORDER = ("hf-eager", "hf-eager+compile", "hf-eager+compile-at-tempo", "tempo", "tempo+compile")
WHERE = {"layer_saved_bytes.json": "this CPU", "compile_cuda.json": "the GPU"}


def plot_compile() -> Path | None:
    """Per sequence length and device: the compile rows (fp32 on this CPU, bf16 on a GPU)."""
    panels = []
    for file, where in WHERE.items():
        data = load(EXPERIMENT, file)
        if data is None:
            continue
        # the compile rows' (seq, dtype, batch): the layer rows share variant names, not dtypes
        shapes = {
            (p.key["seq"], p.key["dtype"], p.key["batch"]) for p in data.select(variant="hf-eager+compile")
        }
        for seq, dtype, batch in sorted(shapes):
            rows = {p.key["variant"]: p for p in data.select(seq=seq, dtype=dtype, batch=batch)}
            panels.append((where, (seq, dtype, batch), {v: rows[v] for v in ORDER if v in rows}))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.6), squeeze=False)
    for ax, (where, (seq, dtype, batch), rows) in zip(axes[0], panels, strict=True):
        results = {v: p.result for v, p in rows.items()}
        compile_panel(ax, results, "bytes", "tempo", f"{where}, seq {seq}, {dtype}, batch {batch}")
    title = "One BERT-Large layer: Tempo against torch.compile (bytes exact, one training step timed)"
    drawn = [p for _, _, rows in panels for p in rows.values()]  # their provenance in the title
    return finish(fig, title, drawn, "tempo_layer_compile.png")


if __name__ == "__main__":
    from measure.parallel import interrupted_in_one_line  # on the path once _common is in

    with interrupted_in_one_line():  # one line, what was written stays
        parse_source(__doc__)
        draw(EXPERIMENT, [plot_compile])
