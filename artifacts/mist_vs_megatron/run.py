"""Mist's main comparison: the best plan of Mist, Megatron-LM (grid), an Aceso-style search
and ZeRO-3 for GPT-3, Llama and Falcon at 1.3B-22B on 2-32 GPUs, all priced by one model.

    python -m artifacts.mist_vs_megatron.run [--scale cpu|paper] [--force] [--jobs N]

Parts (resumable; results in artifacts/mist_vs_megatron/results/):
* comparison: per case (cluster, model, FlashAttention) each system's plan, predicted
  iteration time, memory per stage and tuning time; Mist's plan also as Megatron-LM arguments
  with what Megatron-LM cannot express.
* ablation (GPT-3): from the Megatron-LM grid, Mist's search with checkpoint tuning only, then
  + offloading (and ZeRO), then + imbalance awareness (the full planner).
* engine: plans (TP=2, PP=2, DP=2) trained by megatron-core on 2 gloo processes; measured
  per-rank memory and step time against the prediction (time from a runtime model fitted to
  `mist profile` of this CPU).
FlashAttention on and off; --scale paper gives the Aceso-style search a longer budget.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from measure.parallel import map_points
from measure.results import ResultFile, provenance
from mist.schedule import STRATEGY_FIELDS

from .engine import CPU_ENGINE, run_engine

RESULTS = Path(__file__).parent / "results"
SIZES = [("1.3b", 2, 32), ("2.7b", 4, 64), ("7b", 8, 128), ("13b", 16, 256), ("22b", 32, 512)]  # GPUs, batch
CLUSTERS = {"l4": 2048, "a100-40gb": 4096}  # GPU -> sequence length (the paper's settings)
ARCHS = ("gpt3", "llama", "falcon")
FLASH = {"cpu": (True, False), "paper": (True, False)}
SYSTEMS = ("mist", "megatron", "aceso", "zero3")
ACESO_BUDGET_S = {"cpu": 10.0, "paper": 60.0}
ABLATION = ("megatron", "+checkpointing", "+offloading", "+imbalance")


def _summary(plan) -> dict:
    return {
        "iteration_s": plan.predicted_iteration_s,
        "simulated_s": plan.simulated_iteration_s,
        "tuning_s": plan.tuning_s,
        "tp": plan.tp,
        "dp": plan.dp,
        "micro_batch": plan.micro_batch,
        "stages": [
            {k: getattr(s, k) for k in ("layers", *STRATEGY_FIELDS, "tp", "dp", "memory_gib")}
            for s in plan.stages
        ],
    }


def _setup(gpu: str, arch: str, size: str, flash: bool):
    from mist import cluster, model

    gpus, batch = next((g, b) for s, g, b in SIZES if s == size)
    return model(f"{arch}-{size}", seq=CLUSTERS[gpu], flash=flash), cluster(gpu, gpus), batch


def comparison_point(gpu: str, arch: str, size: str, flash: bool, aceso_budget: float) -> dict:
    from baselines.megatron.aceso import search_aceso
    from baselines.megatron.grid import megatron_args, search_grid
    from baselines.megatron.zero3 import search_zero3
    from mist import NoFeasiblePlan, search

    m, c, batch = _setup(gpu, arch, size, flash)
    runs = {
        "mist": lambda: search(m, c, batch),
        "megatron": lambda: search_grid(m, c, batch),
        "aceso": lambda: search_aceso(m, c, batch, aceso_budget),
        "zero3": lambda: search_zero3(m, c, batch),
    }
    out: dict = {"gpus": c.gpus, "global_batch": batch, "seq": m.seq}
    for name, run in runs.items():
        try:
            plan = run()
        except NoFeasiblePlan as e:
            out[name] = {"infeasible": str(e)}
            continue
        out[name] = _summary(plan)
        if name == "mist":
            args, cannot = megatron_args(plan, m)
            out[name]["megatron_args"] = args
            out[name]["megatron_cannot_express"] = cannot
    return out


def ablation_point(gpu: str, arch: str, size: str) -> dict:
    from baselines.megatron.grid import search_grid
    from mist import NoFeasiblePlan, PlannerOptions, search
    from mist.schedule import SearchSpace

    m, c, batch = _setup(gpu, arch, size, True)
    variants = {
        "+checkpointing": PlannerOptions(
            SearchSpace(zero_stages=(0, 1), offload=False), imbalance_aware=False
        ),
        "+offloading": PlannerOptions(SearchSpace(), imbalance_aware=False),
        "+imbalance": PlannerOptions(SearchSpace(), imbalance_aware=True),
    }
    out = {}
    try:
        out["megatron"] = search_grid(m, c, batch).predicted_iteration_s
    except NoFeasiblePlan:
        out["megatron"] = None
    for name, options in variants.items():
        try:
            out[name] = search(m, c, batch, options).predicted_iteration_s
        except NoFeasiblePlan:
            out[name] = None
    return out


def speedups(store: ResultFile, versus: str) -> dict[str, list[float]]:
    """Per GPU: Mist's speedup over ``versus`` on every case both could plan."""
    out: dict[str, list[float]] = {}
    for key, r in store.points.items():
        a, b = r.get("mist", {}), r.get(versus, {})
        if "iteration_s" in a and "iteration_s" in b:
            out.setdefault(key.split("/")[0], []).append(b["iteration_s"] / a["iteration_s"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=["cpu", "paper"], default="cpu")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    budget = ACESO_BUDGET_S[args.scale]
    cmp_store = ResultFile(
        args.results / "comparison.json",
        provenance(
            {
                "part": "comparison",
                "scale": args.scale,
                "sizes": SIZES,
                "clusters": CLUSTERS,
                "archs": ARCHS,
                "flash": FLASH[args.scale],
                "aceso_budget_s": budget,
                "cost_model": "mist (shipped presets)",
            }
        ),
        args.force,
    )
    todo = [
        (gpu, arch, size, flash, budget)
        for gpu in CLUSTERS for arch in ARCHS for size, _, _ in SIZES for flash in FLASH[args.scale]
        if not cmp_store.done(f"{gpu}/{arch}-{size}/{'flash' if flash else 'noflash'}")
    ]  # fmt: skip
    for (gpu, arch, size, flash, _), result in map_points(comparison_point, todo, args.jobs, "cases"):
        cmp_store.add(f"{gpu}/{arch}-{size}/{'flash' if flash else 'noflash'}", result)
    abl_store = ResultFile(
        args.results / "ablation.json",
        provenance(
            {"part": "ablation", "sizes": SIZES, "clusters": CLUSTERS, "arch": "gpt3", "variants": ABLATION}
        ),
        args.force,
    )
    todo = [
        (gpu, "gpt3", size)
        for gpu in CLUSTERS
        for size, _, _ in SIZES
        if not abl_store.done(f"{gpu}/gpt3-{size}")
    ]
    for (gpu, arch, size), result in map_points(ablation_point, todo, args.jobs, "ablation"):
        abl_store.add(f"{gpu}/{arch}-{size}", result)

    engine = run_engine(CPU_ENGINE, args.results, args.force)
    print("\nPlans trained by megatron-core (2 gloo processes), measured vs predicted:")
    for name, r in engine.points.items():
        worst = max(r["ranks"], key=lambda x: abs(x["memory_error"]))
        print(
            f"  {name}: loss {r['losses'][0]:.2f} -> {r['losses'][-1]:.2f}; memory error worst rank "
            f"{worst['memory_error']:+.1%}; step {r['measured_step_s'] * 1e3:.1f} ms measured, "
            f"{r['predicted_step_s'] * 1e3:.1f} ms predicted ({r['time_error']:+.0%})"
        )
    print("\nMist's speedup (predicted iteration time, same cost model for every system):")
    for versus, paper in (("megatron", "1.28x mean, up to 1.73x"), ("aceso", "1.27x mean, up to 2.04x")):
        for gpu, values in speedups(cmp_store, versus).items():
            print(
                f"  over {versus:<9} on {gpu:<10}: mean {statistics.geometric_mean(values):.2f}x, "
                f"max {max(values):.2f}x, min {min(values):.2f}x over {len(values)} cases (paper: {paper})"
            )
    times = [r["mist"]["tuning_s"] for r in cmp_store.points.values() if "tuning_s" in r.get("mist", {})]
    print(f"  Mist tuning time: median {statistics.median(times):.1f} s, max {max(times):.1f} s")
    print(f"\nresults in {args.results}; figures: nox -s figures")


if __name__ == "__main__":
    main()
