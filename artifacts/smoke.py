"""Kick the tires: touch all three systems in a few minutes on 2 CPU cores, failing loudly.

    python -m artifacts.smoke          (nox -s smoke)

* Tempo: a small BERT with Tempo patched in computes the same loss and gradients as without (dropout
  off), keeps fewer bytes for backward, and takes an AdamW step; the max-batch estimator answers.
* Mist: a plan for GPT-3 1.3B on 8 L4 GPUs, its prediction recomputed from the saved plan file.
* CTA-pipelining: the producer and consumer stage kernels (Triton interpreter) against torch.matmul,
  the consumer refusing to read without its signal, and the latency model's ordering at large M.

Fresh random inputs each run. Nothing is written outside a temporary folder.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

if TYPE_CHECKING:  # torch loads in the checks, where an interruption is one line
    import torch


class SmokeFailure(AssertionError):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise SmokeFailure(what)


def worst_gradient_error(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Per parameter, against its own size with a floor at the model's gradient scale: the key
    biases' gradients are exactly zero in exact arithmetic (softmax ignores a constant shift), so
    both sides hold rounding noise there, whose relative error would mean nothing."""
    import torch

    scale = torch.cat([g.flatten() for g in ref.values()]).norm()
    return max(((ours[n] - g).norm() / (g.norm() + 1e-6 * scale)).item() for n, g in ref.items())


def tempo_step() -> str:
    import torch

    from measure.saved import saved_bytes
    from measure.training import Precision, make_optimizer, train_step
    from tempo.models import build_model, make_batch

    batch = make_batch("bert-mini", "pretraining", 4, 64)
    seed = int.from_bytes(os.urandom(4), "little")
    grads, losses, kept = {}, {}, {}
    for conf in ("hf-eager", "tempo"):
        torch.manual_seed(seed)  # the same weights for both
        model = build_model("bert-mini", "pretraining", conf, dropout=0.0).double().train()
        loss = model(**batch).loss
        loss.backward()
        losses[conf] = loss.item()
        grads[conf] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        kept[conf] = saved_bytes(model, **batch).activation_bytes
    same_loss = abs(losses["tempo"] - losses["hf-eager"]) <= 1e-9 * abs(losses["hf-eager"])
    expect(same_loss, f"Tempo's loss {losses['tempo']} differs from HF's {losses['hf-eager']} (float64)")
    expect(grads["tempo"].keys() == grads["hf-eager"].keys(), "Tempo changes which parameters get gradients")
    worst = worst_gradient_error(grads["tempo"], grads["hf-eager"])
    expect(worst <= 1e-8, f"a gradient differs from HF's by {worst:.1e} relative (float64)")
    expect(
        kept["tempo"] < kept["hf-eager"], f"Tempo keeps {kept['tempo']} B for backward, HF {kept['hf-eager']}"
    )

    model = build_model("bert-mini", "pretraining", "tempo", dropout=0.1).train()  # dropout on, one step
    precision = Precision("fp32")
    optimizer = make_optimizer(model, precision)
    loss = train_step(model, batch, optimizer, precision)
    expect(bool(torch.isfinite(loss)), f"a Tempo training step gave loss {loss.item()}")

    from tempo.maxbatch import estimator

    b, _ = estimator("bert-mini", "pretraining", 64, "fp16", "tempo").max_batch(256 * 2**20)
    expect(b > 0, "the max-batch estimator fits nothing in 256 MiB for a 2-layer BERT")
    saving = 1 - kept["tempo"] / kept["hf-eager"]
    return (
        f"same loss and gradients (worst parameter {worst:.0e}), {saving:.0%} fewer bytes kept "
        "(a 2-layer BERT in float64, dropout off), "
        f"a dropout step at loss {loss.item():.2f}, max batch {b} in 256 MiB"
    )


def mist_plan() -> str:
    from mist import Plan, cluster, model, predict, search

    m, c = model("gpt3-1.3b"), cluster("l4", 8)
    plan = search(m, c, global_batch=32)
    expect(plan.breakdown["fits"], "Mist's best plan does not fit its own memory budget")
    with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
        path = Path(tmp) / "plan.yaml"
        plan.save(path)
        again = predict(Plan.load(path), m, c)
    expect(
        abs(again.predicted_iteration_s - plan.predicted_iteration_s) <= 1e-9 * plan.predicted_iteration_s,
        "the saved plan predicts another iteration time than the plan the search returned",
    )
    shape = f"tp {plan.tp} dp {plan.dp} pp {len(plan.stages)} micro-batch {plan.micro_batch}"
    return (
        f"GPT-3 1.3B on 8 L4: {shape}, {plan.simulated_iteration_s:.2f} s an iteration (predicted: "
        "Mist's cost model, 1F1B simulation), "
        f"tuned in {plan.tuning_s:.1f} s"
    )


def cta_kernels() -> str:
    import torch

    from ctapipe import INTERPRETER_TILING as tiling
    from ctapipe import StageTimeout, launch_stage, sim
    from ctapipe.reference import chain

    m, d, f = (int(v) for v in torch.randint(17, 60, (3,)))  # edges not multiples of the tile
    x, w1, w2 = torch.randn(m, d), torch.randn(d, f) / d**0.5, torch.randn(f, d) / f**0.5
    rows, tiles = tiling.tiles(m, f)
    ready = torch.zeros(rows, dtype=torch.int32)
    h, y = torch.empty(m, f), torch.empty(m, d)
    launch_stage(x, w1, h, ready_out=ready, act="gelu", tiling=tiling)
    launch_stage(h, w2, y, ready_in=ready, wait_target=tiles, tiling=tiling)  # a give-up raises StageTimeout
    ref = chain(x, [w1, w2], ["gelu", "none"])
    error = ((y - ref).abs().max() / ref.abs().max()).item()
    expect(error <= 1e-5, f"the stage kernels: error {error:.1e}")
    blocked = torch.full((m, d), float("nan"))
    try:
        launch_stage(h, w2, blocked, ready_in=ready, wait_target=tiles + 1, timeout_s=0.1, tiling=tiling)
        gave_up = False
    except StageTimeout:
        gave_up = True
    expect(
        gave_up and bool(blocked.isnan().all()),
        "a consumer whose producer never signalled did not raise, or computed tiles anyway",
    )
    r = sim.compare(sim.hardware("h200"), 16384, 2)
    expect(
        r["cta_s"] < r["back_to_back_s"], "the latency model puts CTA-pipelining behind back-to-back GEMMs"
    )
    return (
        f"{m}x{d}x{f} MLP max relative error {error:.0e}; an unsignalled consumer gave up; latency "
        f"model, H200, 2 GPUs, M=16k: CTA {r['cta_vs_microbatch']:+.1%} vs micro-batching"
    )


CHECKS: dict[str, Callable[[], str]] = {"Tempo": tempo_step, "Mist": mist_plan, "CTA-pipelining": cta_kernels}


def main(argv: list[str] | None = None) -> int:
    from measure.cli import OneLineParser
    from measure.parallel import interrupt_handled, raise_if_interrupted, sigterm_as_interrupt

    # no options: --help says what it does, anything else is refused
    OneLineParser(prog="python -m artifacts.smoke", description=__doc__).parse_args(argv)

    sigterm_as_interrupt()  # SIGTERM unwinds like Ctrl-C: the temporary folder goes, one line
    failed, outcomes, name = [], [], next(iter(CHECKS))
    try:
        for name, check in CHECKS.items():
            t0 = time.perf_counter()
            try:
                detail = check()
            except Exception as e:  # report every system, then fail
                # an interrupt that code inside the check dropped (torch's callbacks do) and that
                # surfaced as another error, a child's death by the group's SIGINT, is the interrupt
                raise_if_interrupted()
                failed.append(name)
                outcomes.append(f"{name} failed")
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
                continue
            raise_if_interrupted()  # one dropped inside a check that then went on
            outcomes.append(f"{name} ok")
            print(f"ok   {name} ({time.perf_counter() - t0:.0f} s): {detail}", flush=True)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM unwound as one: a line, not a traceback
        interrupt_handled()
        before = f" after {', '.join(outcomes)}" if outcomes else ""
        print(
            f"interrupted in the {name} check{before}; a smoke run keeps nothing, so "
            "python -m artifacts.smoke starts it again from the first check",
            file=sys.stderr,
        )
        return 130
    if failed:
        print(f"smoke: {', '.join(failed)} failed", file=sys.stderr)
        return 1
    print("smoke: all three systems ok")
    return 0


if __name__ == "__main__":
    from measure.cli import quiet_broken_pipe

    with quiet_broken_pipe():  # `| head`: ends quietly, status 141
        sys.exit(main())
