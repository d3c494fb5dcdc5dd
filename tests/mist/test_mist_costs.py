"""Mist's runtime and interference models: fits, held-out error, fallbacks."""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest

from mist.model.calibrate import check_rates, fit_line
from mist.model.interference import Interference
from mist.model.profile_data import ARTIFACT_DATA
from mist.model.runtime import Line, RuntimeModel, load_runtime_model, roofline_model
from mist.model.specs import cluster, gpus, model

DATA = ARTIFACT_DATA  # vendored in the repository: these tests never skip for missing data


def test_fit_line_recovers_a_known_line(rng):
    c0, rate = rng.uniform(1e-5, 1e-4), rng.uniform(1e11, 1e13)
    work = rng.uniform(1e8, 1e11, 50)
    seconds = (c0 + work / rate) * rng.normal(1, 0.01, 50)
    line = fit_line(work, seconds)
    assert line.rate == pytest.approx(rate, rel=0.05)
    assert np.abs(line(work) / seconds - 1).mean() < 0.02
    flat = fit_line(work, np.full_like(work, 2e-5) * rng.normal(1, 0.01, 50))  # overhead-bound op
    assert np.allclose(flat(work), 2e-5, rtol=0.05)
    with pytest.raises(ValueError, match="fewer than two"):
        fit_line(work[:3], np.array([1.0, 0.0, 0.0]))


def test_fit_line_holds_a_rate_to_the_data_sheet_peak(rng):
    """A GPU's profile times memory-bound ops of a few microseconds, whose launch overheads can tilt a
    line of two or three points above the bandwidth (simulated at H200's sizes: one seed in eight
    ended the fit, and the GPU check's Mist parts with it, with RateAbovePeakError). With ``peak``,
    where no op alone ran faster than the peak, the peak's slope with the least-squares intercept.
    Within the peak it is the unbounded fit to the bit (the control: the vendored GPU fits do not
    move), and so it is where an op alone did (a misread dtype: test_calibrate_holds_a_float32_...)."""
    peak = rng.uniform(1e12, 5e12)
    c0 = rng.uniform(2e-6, 2e-5)  # launch overhead, larger than the work's time at the peak
    work = peak * c0 * rng.uniform(0.05, 0.5, rng.integers(2, 6))
    slower = c0 + work / (peak * rng.uniform(0.5, 0.95))
    assert fit_line(work, slower, peak) == fit_line(work, slower)
    faster = c0 + work / (peak * rng.uniform(1.05, 1.45))  # no hardware does this: noise, a cache
    assert fit_line(work, faster).rate > peak  # what check_rates refuses
    held = fit_line(work, faster, peak)
    assert held.rate == pytest.approx(peak, rel=1e-9) and held.rate <= peak  # check_rates' test, exactly
    # L4's half-precision peak, whose 1/(1/peak) rounds above it: what check_rates then refused
    l4 = gpus()["l4"].flops
    held_l4 = fit_line(work * l4 / peak, faster, l4)
    assert held_l4.rate <= l4
    check_rates(RuntimeModel("l4", {"attention": (held_l4, held_l4)}), "fp16")
    assert (work / faster).max() <= peak  # no op alone faster than the peak: the slope is noise
    # ops that alone ran faster than the peak (large work, a misread dtype or unit: 2x and more):
    # no noise, left for check_rates to refuse
    big = peak * c0 * rng.uniform(5, 50, work.size)
    misread = c0 + big / (peak * rng.uniform(2.0, 16.0))
    assert (big / misread).max() > peak and fit_line(big, misread, peak) == fit_line(big, misread)
    # the intercept that minimises the relative error at the peak's slope (its derivative's zero)
    assert held.c0 == pytest.approx(
        ((faster - work / peak) / faster**2).sum() / (1 / faster**2).sum(), rel=1e-6
    )


def test_fit_line_never_fits_an_infinite_rate(rng):
    """Times that do not grow with the work (an overhead-bound op, as a CPU profile's framework
    excess) were fitted as a rate of +Infinity, which JSON cannot hold and no hardware reaches;
    now a constant, said so (rate None). Work or times that are not finite are refused."""
    work = rng.uniform(1e6, 1e9, 20)
    flat = fit_line(work, 2e-3 * (1 - 0.01 * work / work.max()))  # a little faster with more work
    assert flat.rate is None and flat(work) == pytest.approx(np.full(20, flat.c0))
    assert flat.c0 == pytest.approx(2e-3, rel=0.01)
    grows = fit_line(work, 1e-5 + work / 1e10)  # the control: a rate where the time grows
    assert grows.rate == pytest.approx(1e10, rel=1e-6)
    for bad in (np.inf, np.nan):
        with pytest.raises(ValueError, match="not finite numbers"):
            fit_line(work[:3], np.array([1e-3, bad, 2e-3]))
        with pytest.raises(ValueError, match="not finite numbers"):
            fit_line(np.array([1.0, bad, 3.0]), np.array([1e-3, 2e-3, 3e-3]))


def test_a_gpu_curve_that_does_not_grow_is_above_the_peak():
    """On a GPU a compute or memory-bound curve fitted as a constant is an infinite rate: above
    the data-sheet peak, refused naming the class (check_rates passed it: it skipped what was not
    finite). The framework's excess (no hardware rate) and a CPU's curves may be constants."""
    from dataclasses import replace

    from mist.model.calibrate import RateAbovePeakError, check_rates

    shipped = load_runtime_model("l4")
    check_rates(shipped)  # the control
    gemm_b = shipped.curves["gemm"][1]
    flat = replace(shipped, curves={**shipped.curves, "gemm": (Line(1e-4, None), gemm_b)})
    with pytest.raises(RateAbovePeakError, match=r"gemm forward does not grow with its work .* above l4's"):
        check_rates(flat)
    framework = replace(shipped, curves={**shipped.curves, "framework": (Line(1e-4, None), gemm_b)})
    check_rates(framework)
    check_rates(replace(flat, gpu="cpu"))
    # curves whose work a one-TP profile does not vary (the accumulation's add, the embedding
    # table's gradient) or that are differences (the loss) may be constants; a rate above the
    # peak is still refused
    for cls in ("accumulate", "embedding", "loss"):
        check_rates(replace(shipped, curves={**shipped.curves, cls: (Line(1e-4, None), Line(1e-4, None))}))
        fast = Line(0.0, 1e30)
        with pytest.raises(RateAbovePeakError, match=f"{cls} forward fitted at 1e\\+30"):
            check_rates(replace(shipped, curves={**shipped.curves, cls: (fast, fast)}))


def test_a_model_faster_than_the_hardware_is_refused_wherever_it_enters():
    """Review 2026-12-07: check_rates ran only inside the fit, so a runtime model given to predict
    or search (a preset file edited, a model built in code) priced a GEMM at 826x L4's peak, and
    host copies at 31,000x its PCIe bandwidth, without a word. Refused before any work, naming the
    rate and the bound, as is another GPU's model (checked against its own peaks, it passed); the
    shipped presets are the control, and the CPU's nominal numbers pass."""
    from dataclasses import replace

    from mist import Plan, StagePlan, predict
    from mist.model.calibrate import RateAbovePeakError
    from mist.tuning.problem import Problem, load_interference

    m, c = model("gpt3-1.3b"), cluster("l4", 1)
    plan = Plan.of(m, c, global_batch=8, tp=1, dp=1, micro_batch=1, stages=[StagePlan(layers=24)])
    shipped, interference = load_runtime_model("l4"), load_interference("l4")
    assert predict(plan, m, c, runtime=shipped, interference=interference).predicted_iteration_s > 0
    peak = c.gpu.flops
    fast_gemm = replace(
        shipped, curves={**shipped.curves, "gemm": (Line(0.0, 10 * peak), shipped.curves["gemm"][1])}
    )
    with pytest.raises(RateAbovePeakError, match=r"gemm forward fitted at .* above l4's data-sheet peak"):
        predict(plan, m, c, runtime=fast_gemm)
    copies = Interference(
        interference.factors, "doctored", {**interference.host_rates, "h2d": 2 * c.gpu.host_bw}
    )
    with pytest.raises(
        RateAbovePeakError, match=r"doctored: host copies h2d at .* above l4's data-sheet PCIe"
    ):
        predict(plan, m, c, interference=copies)
    # another GPU's model passed every peak check (its own GPU's): A100's rates priced L4 at 1.19 s, not 3.77
    with pytest.raises(ValueError, match="a runtime model of a100-40gb for a cluster of l4"):
        predict(plan, m, c, runtime=load_runtime_model("a100-40gb"))
    on_cpu = cluster("cpu", 1)
    cpu_copies = Interference(interference.factors, "cpu", {"h2d": 2 * on_cpu.gpu.host_bw})
    Problem.resolve(model("gpt3-tiny"), on_cpu, 8, interference=cpu_copies)  # nominal: not a bound


def test_calibrate_holds_a_float32_profile_to_the_float32_peak(tmp_path, capsys):
    """`mist profile` writes its dtype (fp32 by default) in profile.json, and a float32 GEMM runs on
    the CUDA cores, a quarter of the L4's half-precision peak: the L4's fp16 profiles said to be
    float32 need GEMMs above it, refused in one line naming the class, the rate and the peak. They
    were checked against the half-precision peak whatever the dtype, and fitted. Controls: the same
    profiles said to be fp16; an unknown dtype is refused, not held to some peak."""
    from mist.__main__ import main
    from mist.model.profile_data import PROFILED_SIZES

    out = tmp_path / "l4-profile"  # not an artifact directory's name: profile.json is read
    shutil.copytree(DATA / "gpu-op-profiles" / "l4", out)
    sizes = {k: list(v) for k, v in PROFILED_SIZES.items()}
    meta = {"gpu": "l4", "seq": 2048, "sizes": sizes, "tp_comm_inside": True, "complete": True}
    meta["weight_gradients"] = False  # as the artifact's L4 profiles timed it (see above)
    said = {}
    for dtype, code in (("torch.float16", 0), ("torch.float32", 2), ("torch.float8_e4m3fn", 2)):
        (out / "profile.json").write_text(json.dumps({**meta, "dtype": dtype}))
        assert main(["calibrate", str(out)]) == code
        said[dtype] = capsys.readouterr().err
        assert said[dtype].count("\n") == code // 2, said[dtype]
    peak = r"above l4's data-sheet peak 3.03e\+13 FLOP/s in torch.float32"
    assert re.search(rf"error: .*: gemm \w+ fitted at [\d.e+]+ FLOP/s, {peak}\n$", said["torch.float32"])
    assert "no data-sheet FLOP/s peak of l4 for dtype 'torch.float8_e4m3fn'" in said["torch.float8_e4m3fn"]


def test_overlap_semantics():
    none = Interference()
    assert none.overlap(3.0, 1.0, 2.0, 0.0) == 3.0  # no interference: the longest channel
    slow = Interference()
    slow.factors[:, :] = 1.0
    slow.factors[0, 0b11] = slow.factors[1, 0b11] = 2.0  # compute and g2g halve each other
    # g2g (1 s alone) takes 2 s while compute runs; compute then has 3 - 1 = 2 s of work left
    assert slow.overlap(3.0, 1.0, 0.0, 0.0) == pytest.approx(4.0)
    assert slow.overlap(3.0, 0.0, 0.0, 0.0) == pytest.approx(3.0)  # alone: no slowdown
    rt = Interference.from_json(slow.to_json())
    assert np.array_equal(rt.factors, slow.factors)


def test_roofline_fallback_for_gpus_without_data():
    rm = load_runtime_model("h200")
    assert "roofline" in rm.source
    fwd, bwd = rm.layer_times(model("gpt3-7b"), 1, 2048, 1)
    flops = 24 * 2048 * 4096**2 + 4 * 2048**2 * 4096
    assert flops / 989e12 < fwd < 3 * flops / 989e12  # between peak and a third of it
    assert bwd > fwd
    with pytest.raises(ValueError, match="presets"):
        roofline_model("tpu")


def test_collectives_across_nodes_use_the_inter_node_link():
    rm = load_runtime_model("a100-40gb")
    c = cluster("a100-40gb", 32)
    nbytes = 1 << 30
    intra = rm.collective("all_reduce", nbytes, 8, c)
    inter = rm.collective("all_reduce", nbytes, 8, c, inter_node=True)
    assert inter > 3 * intra  # 50 GB/s NICs against NVLink
    assert rm.collective("all_reduce", nbytes, 1, c) == 0


def test_runtime_model_held_out_error():
    """Fitted on three model sizes, checked on the two it never saw (2.6B, 13B): per-layer
    forward+backward against the profiled per-op sums, TP communication included."""
    from mist.model.calibrate import calibrate

    report = calibrate(DATA / "gpu-op-profiles")
    assert {"l4", "a10g", "v100-sxm2-32gb-seq2048", "a100-sxm4-40gb"} <= set(report)
    for name, r in report.items():
        assert r["held_out_cases"] >= 16
        assert r["median_abs_error"] < 0.10, name
        assert r["mean_abs_error"] < 0.15, name
        assert r["head_mean_abs_error"] < 0.30, name  # final norm + LM head + cross-entropy rows


def test_planning_model_is_fitted_to_every_profiled_point(tmp_path):
    """The model ``calibrate`` returns (what plans are priced by) is fitted to every profile,
    the largest micro-batch included; its reported error is the held-out fit's. Here one size of
    the L4 profiles with its largest micro-batch made 1.5x slower: the fit without it misses it
    by about a third (the held-out error, the negative control); the planning model is pulled
    towards it (a line per op class cannot bend to one point) and prices every profile as a fit
    to all of them does."""
    import csv

    from mist.model.calibrate import calibrate, fit_runtime_model, predicted_layer_seconds
    from mist.model.profile_data import best_algo, read_collectives, read_layer_profiles

    out = tmp_path / "l4"  # the artifact's directory name: its GPU and sequence length are known
    out.mkdir()
    files = sorted((DATA / "gpu-op-profiles" / "l4").glob("gpt_1_3B_*.csv"))
    largest = max(int(f.name.split("_mbs")[1].split("_")[0]) for f in files)
    for f in files:
        with f.open() as fh:
            rows = list(csv.DictReader(fh))
        if f"_mbs{largest}_" in f.name:
            for r in rows:
                for k in ("forward-compute", "backward-compute"):
                    r[k] = str(1.5 * float(r[k]))
        with (out / f.name).open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    for f in (DATA / "gpu-op-profiles" / "l4").glob("prim_gpt_*.csv"):  # the TP all-reduces inside
        (out / f.name).write_bytes(f.read_bytes())
    (r,) = calibrate(out).values()
    assert r["held_out_cases"] >= 4 and r["mean_abs_error"] > 0.25
    profiles = read_layer_profiles(out)
    held = best_algo([p for p in profiles if p.mbs == largest])
    errors = [abs(predicted_layer_seconds(r["model"], p) / p.layer_seconds - 1) for p in held]
    assert sum(errors) / len(errors) < 0.95 * r["mean_abs_error"], (errors, r["mean_abs_error"])
    every = fit_runtime_model(profiles, read_collectives(out), "l4", "every profile")
    for p in best_algo(profiles):
        assert predicted_layer_seconds(r["model"], p) == predicted_layer_seconds(every, p)
    assert "fitted to every l4 profile" in r["model"].source


def test_every_fitted_rate_is_within_the_data_sheet_peak():
    """Compute curves within the FLOP/s peak, memory-bound ones within the HBM bandwidth, for every
    profile set (fitting checks it and fails loudly), and for the shipped presets."""
    from mist.model.calibrate import calibrate, check_rates
    from mist.model.runtime import PRESETS, RuntimeModel

    for r in calibrate(DATA / "gpu-op-profiles").values():
        check_rates(r["model"])  # raises on a rate above the peak
    for path in sorted(PRESETS.glob("runtime_*.json")):
        check_rates(RuntimeModel.from_json(__import__("json").loads(path.read_text())))


def test_a_rate_above_the_peak_fails_loudly():
    """Negative control: the L4 profiles read as if their weight GEMMs' backward timed both
    gradients (it times the input gradient alone) need backward GEMMs faster than the GPU."""
    from dataclasses import replace

    from mist.model import calibrate, profile_data

    l4 = [
        replace(p, weight_gradients=True)
        for p in profile_data.read_layer_profiles(DATA / "gpu-op-profiles" / "l4")
    ]
    with pytest.raises(calibrate.RateAbovePeakError, match=r"gemm backward .* above l4's data-sheet peak"):
        calibrate.fit_runtime_model(l4, {}, "l4", "L4 misread")
    calibrate.fit_runtime_model(
        [replace(p, weight_gradients=False) for p in l4], {}, "l4", "L4"
    )  # as measured


def test_which_profiles_timed_the_weight_gradient(rng):
    """Decided from the data: a weight GEMM's backward is ~2x its forward when both gradients are
    timed (A10G), ~1x when only the input gradient is (L4, A100, V100)."""
    from mist.model.profile_data import backward_has_weight_gradients, read_layer_profiles

    found = {d.name: read_layer_profiles(d)[0].weight_gradients for d in (DATA / "gpu-op-profiles").iterdir()}
    assert found == {
        "a10g": True,
        "l4": False,
        "v100-sxm2-32gb-seq2048": False,
        "a100-sxm4-40gb": False,
        "a100-sxm4-40gb-larger-model": False,
    }
    fwd = rng.uniform(1e-4, 1e-2, 4)
    from mist.model.profile_data import WEIGHT_GEMMS

    ops = {op: (f, f * rng.uniform(1.8, 2.2)) for op, f in zip(WEIGHT_GEMMS, fwd, strict=True)}
    assert backward_has_weight_gradients([ops])
    assert not backward_has_weight_gradients(
        [{k: (f, f * rng.uniform(0.7, 1.1)) for k, (f, _) in ops.items()}]
    )


def test_weight_gradient_gemm_priced_as_what_timed_it(rng):
    """Where the profiles timed both backward GEMMs, each is half the backward column; where they
    timed the input gradient alone, the untimed weight gradient is priced as a forward GEMM of the
    same FLOPs, so a layer's backward is input gradient + forward-speed weight gradient."""
    from mist.model import calibrate, profile_data, runtime

    for name, timed in (("a10g", True), ("l4", False)):
        data = profile_data.read_layer_profiles(DATA / "gpu-op-profiles" / name)
        rm = calibrate.fit_runtime_model(data, {}, profile_data.PROFILE_GPU[name], name)
        gemm_f, gemm_b = rm.curves["gemm"]
        assert rm.wgrad_line == (gemm_b if timed else gemm_f), name
        m = model("gpt3-1.3b")
        mbs = int(rng.integers(1, 9))
        with_w = rm.layer_times(m, mbs, m.seq, 1)[1]
        without = rm.layer_times(m, mbs, m.seq, 1, weight_gradients=False)[1]
        per_op = [fn(mbs, m.seq, 1)[0] for _, kind, fn in runtime.op_features(m) if kind == "gemm"]
        assert len(per_op) == 4  # qkv, dense, two MLP GEMMs
        assert with_w - without == pytest.approx(sum(float(rm.wgrad_line(f)) for f in per_op), rel=1e-9)


def test_interference_fit_beats_no_interference_on_held_out_runs():
    from mist.model.interference import fit_interference

    for path in sorted((DATA / "gpu-bandwidth").glob("*.json")):
        inter, rep = fit_interference(path)
        assert rep["held_out_mean_abs_error"] < 0.5 * rep["no_interference_mean_abs_error"], path.name
        assert set(inter.host_rates) == {"h2d", "d2h"}
        assert 1e9 < inter.host_rates["h2d"] < 64e9


def test_pipeline_messages_priced_from_the_measured_p2p_bandwidth():
    """The shipped presets price a stage-to-stage message from the artifact's p2p benchmark (A10G
    without NVLink or PCIe peer access: ~1.4 GB/s), and a stage pays two messages per neighbour
    per micro-batch (activation forward, its gradient backward)."""
    from mist.model.profile_data import read_p2p
    from mist.model.specs import GradAccumulation
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import SearchSpace, Setting, evaluate_stage, layer_numbers, strategy_grid

    size, rate = max(read_p2p(DATA / "gpu-op-profiles" / "a10g")["intra"])
    rm = load_runtime_model("a10g")
    c = cluster("a10g", 8)
    assert rm.p2p(size, c) == pytest.approx(size / rate, rel=0.1)
    m = model("gpt3-1.3b")
    # an engine without gradient accumulation cost: the edge stages' embedding/head gradients add nothing
    free = GradAccumulation("none", 0.0, True)
    st = Setting(m, c, *cost_models(c), 1, 1, 2, 4, grad_accumulation=free)
    ln = layer_numbers(st)
    grid = strategy_grid(6, SearchSpace(offload=False, recompute=False, zero_stages=(0,)))
    middle = evaluate_stage(st, ln, 6, 2, False, False, grid, 8)["compute"][0]
    alone = evaluate_stage(st, ln, 6, 1, True, True, grid, 8)["compute"][0]
    edges = ln.head_fwd + ln.head_bwd + ln.embed_fwd + ln.embed_bwd
    assert middle - (alone - edges) == pytest.approx(4 * ln.p2p)
    assert ln.p2p == pytest.approx(rm.p2p(2.0 * 2 * m.seq * m.hidden, c))


def test_an_engines_gradient_bytes_are_priced_in_memory_and_in_the_dp_sum():
    """Megatron-LM at its bf16 default keeps fp32 main grads, sums them over DP in fp32 and steps
    them as they are (its .float() of an fp32 tensor is the tensor); the 16-bit engines' step makes
    an fp32 copy. The model priced 2 bytes a parameter for every engine (review 2026-12-07:
    `--engine megatron-lm` moved the time, not the memory: about 1.3 GiB a GPU missing for
    gpt3-1.3b's first stage). The state: 2 bytes a parameter more (ZeRO-2: a shard's over 2
    replicas), no step copy; where backward binds (no recomputation, two micro-batches in flight) a
    middle stage's peak differs by exactly that; the DP sum after backward (ZeRO-0/1) sends more."""
    from mist.model.specs import GRAD_ACCUMULATION
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import (
        EDGE_FIELDS,
        OPTIMIZER_STEP_BYTES_PER_PARAM,
        SearchSpace,
        Setting,
        _state_bytes,
        evaluate_stage,
        layer_numbers,
        strategy_grid,
    )

    m, c = model("gpt3-1.3b"), cluster("l4", 4)
    grid = strategy_grid(6, SearchSpace(offload=False, recompute=False, zero_stages=(0, 1, 2)))
    zero = grid["zero"]
    strategy = {name: grid[name] for name in EDGE_FIELDS}
    priced, state = {}, {}
    for engine in ("megatron-core", "megatron-lm"):
        accumulation = GRAD_ACCUMULATION[engine]
        st = Setting(m, c, *cost_models(c), 1, 2, 1, 2, grad_accumulation=accumulation)
        priced[engine] = evaluate_stage(st, layer_numbers(st), 6, 2, False, False, grid, 8)
        state[engine] = _state_bytes(1.0, strategy, 2, accumulation)  # a parameter's
    grads = np.where(zero >= 2, 1.0, 2.0)  # 2 bytes more a parameter, over 2 replicas at ZeRO-2
    assert np.allclose(state["megatron-lm"]["gpu"] - state["megatron-core"]["gpu"], grads, rtol=1e-12)
    opt_share = np.where(zero >= 1, 0.5, 1.0)
    assert np.allclose(state["megatron-core"]["step_copy"], OPTIMIZER_STEP_BYTES_PER_PARAM * opt_share)
    assert not state["megatron-lm"]["step_copy"].any()
    params = 6 * layer_numbers(st).params
    more = priced["megatron-lm"]["memory"] - priced["megatron-core"]["memory"]
    assert np.allclose(more, grads * params, rtol=1e-9)
    sync = priced["megatron-lm"]["sync"] - priced["megatron-core"]["sync"]
    assert (sync[zero < 2] > 0).all()


def test_torchtitan_is_priced_for_its_fp32_reductions():
    """torchtitan 0.2.2 reduces gradients in fp32 (FSDP2's only reduce dtype; DDP's gradients under
    autocast are fp32), and `--target torchtitan` priced 16-bit reductions (docs/mist.md said so).
    The DP sum after backward (ZeRO-0) and ZeRO-2/3's reduce-scatters send twice the bytes: the
    same collectives at twice the size, the weight gathers as they were. Unsharded, torchtitan
    keeps 2 bytes a parameter more than priced, and DDP 6 (review 2026-12-07); so does its ZeRO-1
    (FSDP2 in a pipeline: whole fp32 gradients over the micro-batches), 2 (review 2026-12-07)."""
    from mist.model.specs import GRAD_ACCUMULATION
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import (
        SearchSpace,
        Setting,
        _buffer_gradient_sum,
        _zero_per_micro_batch,
        evaluate_stage,
        layer_numbers,
        strategy_grid,
    )

    dp = random.choice([2, 4])
    m, c = model("llama-1.3b"), cluster("l4", dp)
    grid = strategy_grid(6, SearchSpace(offload=False, recompute=False, zero_stages=(0, 1, 2, 3)))
    zero = grid["zero"]
    runtime, interference = cost_models(c)
    core, titan = (
        Setting(m, c, runtime, interference, 1, dp, 1, 1, grad_accumulation=GRAD_ACCUMULATION[engine])
        for engine in ("megatron-core", "torchtitan")
    )
    weight_bytes = random.uniform(1e6, 1e9)
    assert _buffer_gradient_sum(titan, weight_bytes, False, 0) == pytest.approx(
        runtime.collective("all_reduce", 2 * weight_bytes, dp, c, False), rel=1e-12
    )
    assert _buffer_gradient_sum(core, weight_bytes, False, 0) == pytest.approx(
        runtime.collective("all_reduce", weight_bytes, dp, c, False), rel=1e-12
    )
    layers, edge = random.randint(1, 8), (weight_bytes / 7,)
    _, g2g_core = _zero_per_micro_batch(core, layers, weight_bytes, edge, zero, zero, False)
    _, g2g_titan = _zero_per_micro_batch(titan, layers, weight_bytes, edge, zero, zero, False)
    more = sum(
        count
        * (
            runtime.collective("reduce_scatter", 2 * w, dp, c, False)
            - runtime.collective("reduce_scatter", w, dp, c, False)
        )
        for count, w in ((layers, weight_bytes), (1, edge[0]))
    )
    assert np.allclose(g2g_titan - g2g_core, np.where(zero >= 2, more, 0.0), rtol=1e-9)
    assert (g2g_titan[zero >= 2] > g2g_core[zero >= 2]).all()
    # memory: FSDP2's fp32 shards are the 16 bytes a parameter priced; unsharded, autocast's fp32
    # weights, their bf16 copies kept for backward, fp32 gradients and moments take 18, and DDP's
    # bucket copies of the gradients 4 more (the model priced 16 for both); in a pipeline (ZeRO-1)
    # FSDP2's whole gradients are fp32, 2 more
    for replicas, extra in ((1, 2.0), (dp, 6.0)):
        memory = {}
        for engine in ("megatron-core", "torchtitan"):
            st = Setting(
                m, c, runtime, interference, 1, replicas, 1, 2, grad_accumulation=GRAD_ACCUMULATION[engine]
            )
            memory[engine] = evaluate_stage(st, layer_numbers(st), layers, 2, False, False, grid, 8)["memory"]
        params = layers * layer_numbers(core).params
        more = memory["torchtitan"] - memory["megatron-core"]
        expected = np.where(zero == 0, extra, 2.0) * params
        # (ZeRO-2/3: FSDP2's fp32 reduce-scatter input, test_torchtitans_fsdp2_ends_a_layers_...)
        unsharded = zero < 2
        assert np.allclose(more[unsharded], expected[unsharded], rtol=1e-9, atol=1.0), replicas


def test_torchtitans_fsdp2_ends_a_layers_backward_holding_fp32_reduce_input():
    """Review 2026-12-07: FSDP2 reduce-scatters in torchtitan's reduce dtype (fp32), so a layer's
    backward ends holding its bf16 gradients and an fp32 copy of them, 6 bytes a parameter, at
    ZeRO-2 (FSDP2 without resharding) as at ZeRO-3; the model priced mist.engine.run's 4 at ZeRO-3
    and nothing at ZeRO-2 for torchtitan too. The engines' own pricing is unchanged."""
    from mist.model.specs import GRAD_ACCUMULATION
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import (
        SearchSpace,
        Setting,
        _sharded_grads_end_bytes,
        evaluate_stage,
        layer_numbers,
        strategy_grid,
    )

    zero = np.array([0, 1, 2, 3])
    weights = random.uniform(1e6, 1e9)
    core, titan = GRAD_ACCUMULATION["megatron-core"], GRAD_ACCUMULATION["torchtitan"]
    assert list(_sharded_grads_end_bytes(core, zero, weights, own=2.0)) == [0, 0, 0, 2 * weights]
    assert list(_sharded_grads_end_bytes(core, zero, weights, own=1.0)) == [0, 0, 0, weights]
    for own in (1.0, 2.0):  # FSDP2's: the gradients (2 bytes) and the fp32 input (4), whatever the module
        assert list(_sharded_grads_end_bytes(titan, zero, weights, own)) == [0, 0, 3 * weights, 3 * weights]
    dp = random.choice([2, 4])
    m, c = model("llama-1.3b"), cluster("l4", dp)
    grid = strategy_grid(6, SearchSpace(offload=False, recompute=False, zero_stages=(2, 3)))
    runtime, interference = cost_models(c)
    memory = {}
    for engine in ("megatron-core", "torchtitan"):
        st = Setting(m, c, runtime, interference, 1, dp, 1, 1, grad_accumulation=GRAD_ACCUMULATION[engine])
        layers = 6
        memory[engine] = evaluate_stage(st, layer_numbers(st), layers, 2, False, False, grid, 8)["memory"]
    layer_weights = 2.0 * layer_numbers(st).params
    more = memory["torchtitan"] - memory["megatron-core"]
    # the end's bytes enter through a maximum with the peak op's: at most what they grew by
    grew = np.where(grid["zero"] == 2, 3.0, 1.0) * layer_weights
    assert (more >= 0).all() and (more <= grew * (1 + 1e-9)).all(), (more, grew)
    assert (more[grid["zero"] == 2] > 0).all()  # a Llama layer's end holds more than its peak op


def test_the_lm_head_holds_no_position_table():
    """Review 2026-12-07: the last stage's untied head was priced as the embedding, the learned
    position table included (gpt3-1.3b: 4.19M parameters too many, ~67 MB of state at ZeRO-0). The
    head is the token table's shape; the embedding keeps its position table where positions are
    learned (GPT-3), and the two are equal where they are not (Llama's rotary)."""
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import Setting, _edge_params, _edge_weight_bytes, layer_numbers

    c = cluster("l4", 8)
    for name, positions in (("gpt3-1.3b", True), ("llama-1.3b", False)):
        m = model(name)
        ln = layer_numbers(Setting(m, c, *cost_models(c), 2, 1, 1, 2))  # TP 2: a half of each table
        assert ln.head_params == m.vocab * m.hidden / 2
        assert ln.embed_params - ln.head_params == (m.seq * m.hidden if positions else 0)
        assert _edge_params(ln, False, True) == ln.head_params and _edge_params(ln, False, False) == 0
        assert _edge_params(ln, True, True) == ln.embed_params + ln.head_params
        assert _edge_weight_bytes(ln, False, True) == 2 * ln.head_params  # the head alone
        assert _edge_weight_bytes(ln, True, True) == 2 * ln.embed_params  # the larger, one at a time


def test_line_is_a_plain_record():
    assert Line(1.0, 2.0)(4.0) == 3.0


def test_profile_command_writes_what_calibrate_fits(tmp_path, rng):
    """`mist profile` on this CPU at tiny scale: the artifact's CSV format, then a fit of it."""
    import torch

    from mist.engine.profiler import write_profiles as write
    from mist.model.calibrate import calibrate
    from mist.model.profile_data import (
        EMBEDDING_OP,
        FINAL_NORM_OP,
        FRAMEWORK_OP,
        GATED_LAYER_OP,
        GRAD_ACCUMULATE_OP,
        HEAD_OP,
        TEMPO_GATED_OP,
        TEMPO_OP,
        read_layer_profiles,
    )

    vocab = int(rng.choice([128, 256, 512]))
    before = torch.get_num_threads()
    files = write(
        tmp_path,
        "cpu",
        64,
        4,
        32,
        [1, 2, 4],
        [1, 2],
        torch.float32,
        "cpu",
        repeats=2,
        vocab=vocab,
        tempo=True,
    )
    assert torch.get_num_threads() == before  # one thread while profiling (as each rank), restored after
    assert len(files) == 6
    profiles = read_layer_profiles(tmp_path)
    # the rows outside the layer, at the profiled model's vocabulary: what the head and embedding cost
    assert all(p.vocab == vocab and {EMBEDDING_OP, FINAL_NORM_OP, HEAD_OP} <= set(p.ops) for p in profiles)
    # each is a difference of two timings, clipped at zero: at two repeats on a busy machine any of
    # them may be (test_profile_rows_are_the_stated_differences checks the arithmetic exactly)
    assert all(min(p.ops[op]) >= 0 for p in profiles for op in (EMBEDDING_OP, HEAD_OP))
    assert {(p.mbs, p.tp) for p in profiles} == {(b, t) for b in (1, 2, 4) for t in (1, 2)}
    assert all(p.layer_seconds > 0 and not p.tp_comm_inside for p in profiles)
    # megatron-core's whole layer was timed too: its excess over the ops is a row, and a curve
    assert all(FRAMEWORK_OP in p.ops and min(p.ops[FRAMEWORK_OP]) >= 0 for p in profiles)
    # and the layers with Tempo's ops (GPT-3's, Llama's): their excess over the plain ones
    assert all(min(p.ops[op]) >= 0 for p in profiles for op in (TEMPO_OP, TEMPO_GATED_OP))
    # and the gradient accumulation's add, as the engine makes it: one time, in both columns
    assert all(p.ops[GRAD_ACCUMULATE_OP][0] == p.ops[GRAD_ACCUMULATE_OP][1] > 0 for p in profiles)
    with pytest.raises(ValueError, match="needs framework"):
        write(tmp_path, "cpu", 64, 4, 32, [1], [1], torch.float32, "cpu", framework=False, tempo=True)
    report = calibrate(tmp_path)
    (r,) = report.values()
    assert r["gpu"] == "cpu" and r["held_out_cases"] == 2  # the largest micro-batch, both TP sizes
    assert r["mean_abs_error"] is not None
    rm = r["model"]
    assert "framework" in rm.curves and {"loss", "embedding", "accumulate", "gated"} <= set(rm.curves)
    # the plain Llama layer, whole: its forward is timed directly, its backward as (both) - forward
    assert all(p.ops[GATED_LAYER_OP][0] > 0 <= p.ops[GATED_LAYER_OP][1] for p in profiles)
    assert rm.accumulate_line == rm.curves["accumulate"][0]  # the add priced by its own line
    spec = profiles[0].model
    with_overhead = sum(rm.layer_times(spec, 2, spec.seq, 1))
    rm.curves.pop("framework")
    assert with_overhead >= sum(rm.layer_times(spec, 2, spec.seq, 1))


def test_profile_rows_are_the_stated_differences(monkeypatch):
    """A profile point's rows from stated timings (no clock): the framework's and Tempo's excesses,
    the plain Llama layer whole (not the Tempo one), the edges as differences of whole models, and
    a difference below zero as none. Control: the timings swapped give other rows."""
    import torch

    from mist.engine.profiler import layer as prof
    from mist.model.profile_data import (
        EMBEDDING_OP,
        FINAL_NORM_OP,
        FRAMEWORK_OP,
        GATED_LAYER_OP,
        HEAD_OP,
        TEMPO_GATED_OP,
        TEMPO_OP,
    )

    def op_row(name, fwd, bwd):
        return {"op_name": name, "forward-compute": fwd, "backward-compute": bwd, "input_size": 1.0}

    whole = {  # (tempo, gated): (forward, backward) seconds
        (False, False): (10e-6, 30e-6),
        (True, False): (9e-6, 33e-6),
        (False, True): (14e-6, 40e-6),
        (True, True): (15e-6, 38e-6),
    }
    models = {(False, False): (5e-6, 9e-6), (True, False): (6e-6, 12e-6), (True, True): (9e-6, 11e-6)}
    monkeypatch.setattr(prof, "profile_layer", lambda *a: [op_row("a", 3.0, 5.0), op_row("b", 4.0, 6.0)])

    def layer_seconds(*shape, tempo=False, gated_ffn=None):
        return whole[tempo, gated_ffn is not None]

    monkeypatch.setattr(prof, "megatron_layer_seconds", layer_seconds)
    monkeypatch.setattr(prof, "grad_accumulation_seconds", lambda *a: 2e-6)
    monkeypatch.setattr(prof, "_gpt_model_seconds", lambda *a: models)
    monkeypatch.setattr(prof, "forward_backward_seconds", lambda *a: (1e-6, 1.5e-6))  # the final norm
    shape = {"hidden": 64, "heads": 4, "seq": 32, "micro_batches": (1,), "tps": (1,), "dtype": torch.float32}
    job = prof.ProfileJob(
        device="cpu",
        gpu="cpu",
        repeats=1,
        framework=True,
        tempo=True,
        threads=1,
        vocab=128,
        rounds=1,
        **shape,
    )
    rows = {r["op_name"]: (r["forward-compute"], r["backward-compute"]) for r in prof._point_rows(job, 1, 1)}
    expect = {
        FRAMEWORK_OP: (10 - 7, 30 - 11),
        TEMPO_OP: (0, 3),  # Tempo's forward is faster here: priced as no excess
        TEMPO_GATED_OP: (1, 0),
        GATED_LAYER_OP: (14, 40),
        EMBEDDING_OP: (1, 3),
        FINAL_NORM_OP: (1, 1.5),
        HEAD_OP: (9 - 6 - 1, 0),  # 11 - 12 - 1.5 < 0
    }
    for op, (fwd, bwd) in expect.items():
        assert rows[op] == (pytest.approx(fwd), pytest.approx(bwd)), op
    whole[False, True], whole[True, True] = whole[True, True], whole[False, True]  # control
    rows = {r["op_name"]: (r["forward-compute"], r["backward-compute"]) for r in prof._point_rows(job, 1, 1)}
    assert rows[GATED_LAYER_OP] != (pytest.approx(14), pytest.approx(40))


@pytest.mark.slow
def test_collective_benchmark_feeds_the_runtime_model(tmp_path):
    """`mist profile --collectives 2`: gloo among 2 local processes, in the artifact's format;
    the fitted model then prices a 2-way all-reduce from those measurements, not the preset link."""
    from mist.engine.profiler import profile_collectives, write_collectives
    from mist.model.calibrate import fit_runtime_model
    from mist.model.profile_data import read_collectives

    rows = profile_collectives(2, "cpu", sizes=[4096, 1 << 20], repeats=3)
    assert set(rows) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert all(len(r) == 2 and all(sec > 0 for _, sec in r) for r in rows.values())
    write_collectives(tmp_path, 2, "cpu", repeats=3)
    measured = read_collectives(tmp_path)
    assert set(measured) == {(c, 2) for c in rows}
    rm = fit_runtime_model([], measured, "cpu", "test")
    line = rm.collectives["all_reduce", 2]
    assert float(rm.collective("all_reduce", 1 << 20, 2)) == pytest.approx(float(line(1 << 20)))
    # the pipeline message: written as the artifact's p2p file, priced by its own line
    assert (tmp_path / "p2p_intra_node.csv").exists()
    assert rm.p2p(1 << 20, cluster("cpu", 2)) == pytest.approx(float(rm.collectives["send_recv", 2](1 << 20)))
    with pytest.raises(ValueError, match="at least 2"):
        profile_collectives(1, "cpu")


@pytest.mark.slow
def test_zero_sync_benchmark_times_the_engines_own_collectives(tmp_path):
    """`mist profile --collectives 2` times ZeRO-1/2's step collectives by running the engine's own
    objects (ContiguousGrads' all-reduce, ShardedMasterAdamW.broadcast_weights) among 2 gloo
    processes; the files read back as collectives and the fitted model prices them by those lines,
    for 2 processes only, and nothing for no bytes. Bad sizes and one process are refused."""
    from mist.engine.profiler import profile_zero_sync, write_zero_sync
    from mist.model.calibrate import fit_runtime_model
    from mist.model.profile_data import read_collectives
    from mist.model.runtime import ENGINE_COLLECTIVES

    sizes = [4096, 1 << 20]
    written = write_zero_sync(tmp_path, 2, "cpu", sizes, repeats=3, rounds=2)
    assert [p.name for p in written] == [f"prim_gpt_local_{k}_2gpus.csv" for k in ENGINE_COLLECTIVES]
    measured = read_collectives(tmp_path)
    assert set(measured) == {(k, 2) for k in ENGINE_COLLECTIVES}
    assert all(len(rows) == 2 and all(sec > 0 for _, sec in rows) for rows in measured.values())
    rm = fit_runtime_model([], measured, "cpu", "test")
    for kind, price in (("zero_grad_sum", rm.zero_grad_sum), ("zero_weight_sync", rm.zero_weight_sync)):
        assert float(price(1 << 20, 2)) == pytest.approx(float(rm.collectives[kind, 2](1 << 20)))
        assert float(price(0.0, 2)) == 0.0  # no bytes, no collective
        assert price(1 << 20, 4) is None and price(1 << 20, 2, inter_node=True) is None  # not measured
    with pytest.raises(ValueError, match="at least 2 processes"):
        profile_zero_sync(1, "cpu", sizes)
    with pytest.raises(ValueError, match="at least 4 bytes"):
        profile_zero_sync(2, "cpu", [2])


def test_accumulation_priced_by_its_measured_add_where_profiled(rng):
    """Where `mist profile` timed the gradient accumulation's add (the ``accumulate`` curve), the
    model prices the add by it; elsewhere (every shipped GPU preset) by the residual add's forward
    line, as before. Negative control: the same model without the curve prices the residual add's."""
    import dataclasses

    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import SearchSpace, Setting, evaluate_stage, layer_numbers, strategy_grid

    c, m = cluster("a10g", 8), model("gpt3-1.3b")
    runtime, interference = cost_models(c)
    add = Line(float(rng.uniform(0, 1e-4)), float(rng.uniform(1e9, 1e12)))
    measured = dataclasses.replace(runtime, curves={**runtime.curves, "accumulate": (add, add)})
    layers, g = int(rng.integers(1, 7)), int(rng.integers(2, 40))
    grid = strategy_grid(layers, SearchSpace(offload=False, recompute=False))
    st = Setting(m, c, runtime, interference, 1, 1, 1, 2)
    ln = layer_numbers(st)
    base = evaluate_stage(st, ln, layers, 1, False, False, grid, g)["compute"]
    moved = st.grad_accumulation.bytes_per_param * layers * ln.params
    for rt, line in ((measured, add), (runtime, runtime.curve("dropout_add")[0])):
        assert rt.accumulate_line == line
        priced = evaluate_stage(dataclasses.replace(st, runtime=rt), ln, layers, 1, False, False, grid, g)
        expected = (
            base - runtime.accumulate_line(moved) + line(moved)
        )  # one add a micro-batch (megatron-core)
        np.testing.assert_allclose(priced["compute"], expected, rtol=1e-9)


def test_buffer_sum_and_weight_sync_priced_as_the_engine_issues_them(rng):
    """Where the runtime model has the engine's measured step collectives, ZeRO-0's and ZeRO-1's
    gradient sum (one operation in mist.engine.run: the all-reduce of its gradient buffer, so one
    line) and ZeRO-1/2's weight sync (its broadcasts) are priced by them, the embedding/head's
    (ZeRO-0 here) too; elsewhere, as on every shipped GPU preset, by Megatron-LM's: DDP's
    all-reduce (ZeRO-0), the distributed optimizer's reduce-scatter and all-gather. ZeRO-3 (nothing
    after backward) is unchanged. Negative control: the same model without those lines prices the
    Megatron-LM collectives."""
    import dataclasses

    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import Setting, _gradient_sync

    c, m = cluster("a100-40gb", 8), model("gpt3-1.3b")
    dp = 2
    runtime, interference = cost_models(c)
    grad_sum = Line(float(rng.uniform(1e-4, 1e-2)), float(rng.uniform(1e9, 1e11)))
    weight_sync = Line(float(rng.uniform(1e-4, 1e-2)), float(rng.uniform(1e9, 1e11)))
    engine = dataclasses.replace(
        runtime,
        collectives={
            **runtime.collectives,
            ("zero_grad_sum", 2): grad_sum,
            ("zero_weight_sync", 2): weight_sync,
        },
    )
    stage, edge = float(rng.uniform(1e6, 1e9)), float(rng.uniform(0.0, 1e8))
    zero = np.array([0, 1, 2, 3])
    edge_zero = np.zeros(4)
    ddp = (runtime.collective("all_reduce", stage, dp, c), runtime.collective("all_reduce", edge, dp, c))
    for rt, (zero0, edge_sum), zero1, synced in (
        (engine, (grad_sum(stage), grad_sum(edge)), grad_sum(stage), weight_sync(stage)),
        (
            runtime,
            ddp,
            runtime.collective("reduce_scatter", stage, dp, c),
            runtime.collective("all_gather", stage, dp, c),
        ),
    ):
        st = Setting(m, c, rt, interference, 1, dp, 1, 2)
        before, after = _gradient_sync(st, stage, edge, zero, edge_zero, False)
        expected = np.array([zero0, zero1, 0.0, 0.0]) + edge_sum
        np.testing.assert_allclose(before, expected, rtol=1e-12)
        np.testing.assert_allclose(after, [0.0, synced, synced, 0.0], rtol=1e-12)
    # the two lines differ, so the control tells them apart
    assert not np.isclose(float(grad_sum(stage)), float(ddp[0]), rtol=1e-6)


def test_the_step_crosses_the_host_link_where_a_tensor_is_not_where_it_steps(rng):
    """optimizer_step_s: a parameter's step is the device's Adam or, the offloaded optimizer's
    share, the host's, and each fp16 tensor not where its step runs crosses the host link once
    (mist.engine.run's OffloadedMasterAdamW and MasterWeightAdamW): a host-stepped gradient made
    on the device goes down, its weight living on the device comes up; a device-stepped gradient
    summed on the host comes up, its weight resting on the host goes down. The three host shares
    are nested (the engine takes the weights at rest on the host first: split_by_fraction), so at
    random fractions it is a count over parameters whose host shares are prefixes of one order.
    Controls: with everything on the host nothing crosses; Megatron-LM's optimizer offload alone
    moves the gradient down and the weight up."""
    from mist.model.runtime import cpu_adam_params_per_s
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import Setting, _host_rates, optimizer_step_s

    c = cluster(str(rng.choice(["l4", "a100-40gb", "h100", "h200"])), 8)
    st = Setting(model("gpt3-1.3b"), c, *cost_models(c), 1, 1, 1, 2)
    d2h, h2d = _host_rates(st)
    on_device, on_host = optimizer_step_s(st, 0.0), 1 / cpu_adam_params_per_s(c)
    assert optimizer_step_s(st, 1.0, 1.0, 1.0) == pytest.approx(on_host, rel=1e-12)
    assert optimizer_step_s(st, 1.0) == pytest.approx(on_host + 2 / d2h + 2 / h2d, rel=1e-12)
    assert optimizer_step_s(st, 0.0, 1.0, 1.0) == pytest.approx(on_device + 2 / d2h + 2 / h2d, rel=1e-12)

    n = 4000  # parameters of one size: parameter i is in a host share of fraction f where i < f n
    counts = [rng.integers(0, n + 1, 64) for _ in range(3)]
    o, w, g = (k / n for k in counts)
    i = np.arange(n)[:, None]
    stepped, resting, summed = (i < k for k in counts)
    down = (stepped & ~summed) | (~stepped & resting)
    up = (stepped & ~resting) | (~stepped & summed)
    counted = (
        np.mean(np.where(stepped, on_host, on_device), axis=0)
        + 2 * np.mean(down, axis=0) / d2h
        + 2 * np.mean(up, axis=0) / h2d
    )
    np.testing.assert_allclose(optimizer_step_s(st, o, w, g), counted, rtol=1e-9)


ZERO_STAGES = np.array([0, 1, 2, 3])


def _added_by(gpu: str, dp: int, params: float, **fractions) -> tuple:
    """(sync, step) seconds those offloaded fractions add to the last micro-batch of a stage of
    ``params`` parameters (no embedding or head) at each of ZERO_STAGES over ``dp`` replicas on
    ``gpu``'s preset, and the Setting priced."""
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import EDGE_FIELDS, Setting, _state_bytes, _sync_and_step

    c = cluster(gpu, 8)
    st = Setting(model("gpt3-1.3b"), c, *cost_models(c), 1, dp, 1, 2)
    none = dict.fromkeys(EDGE_FIELDS, np.zeros(1))
    priced = []
    for offloaded in ({}, fractions):
        strategy = dict.fromkeys(EDGE_FIELDS, np.zeros(4)) | {"zero": ZERO_STAGES, **offloaded}
        parts = (
            (_state_bytes(params, strategy, dp, st.grad_accumulation), strategy),
            (_state_bytes(0.0, none, dp, st.grad_accumulation), none),
        )
        priced.append(_sync_and_step(st, 2 * params, 0.0, ZERO_STAGES, np.zeros(1), False, parts))
    (sync, step), (sync_off, step_off) = priced
    return sync_off - sync, step_off - step, st


def test_zero01_host_gradients_go_through_the_device_for_the_dp_sum(rng):
    """ZeRO-0/1's gradients summed on the host take a trip up to the device and back before the
    clipping barrier, once a step (GradientOffload.all_reduce: NCCL reads device memory): 2
    bytes a parameter each way. Not at one replica (no sum), nor under ZeRO-2/3 (reduced on the
    device as made, then drained)."""
    from mist.tuning.stage_cost import _host_rates

    gpu, params, g = str(rng.choice(["l4", "a100-40gb", "h200"])), rng.uniform(1e7, 1e9), rng.uniform(0.1, 1)
    for dp in (1, 2, 4):
        sync, _, st = _added_by(gpu, dp, params, offload_grads=g)
        d2h, h2d = _host_rates(st)
        trip = np.where((ZERO_STAGES < 2) & (dp > 1), 2 * g * params * (1 / h2d + 1 / d2h), 0.0)
        np.testing.assert_allclose(sync, trip, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("host_stepped", ["none", "some", "all"])
def test_zero12_weights_at_rest_on_the_host_are_broadcast_through_the_device(rng, host_stepped):
    """ZeRO-1/2's broadcast of the updated weights carries those at rest on the host through the
    device (zero.broadcast_through), 2 bytes a parameter: each rank's own share of them up where
    it stepped them on the host (those stepped on the device are cast into the message from their
    master there), and the other owners' shares down. Not at one replica (nothing to broadcast),
    under ZeRO-0 (no owners) or ZeRO-3 (its shards are the weights: nothing broadcast). The
    step's own crossings are optimizer_step_s's, priced per parameter the rank steps."""
    from mist.tuning.stage_cost import _host_rates, optimizer_step_s

    gpu, params, w = str(rng.choice(["l4", "a100-40gb", "h200"])), rng.uniform(1e7, 1e9), rng.uniform(0.1, 1)
    # the optimizer's share; "some": less than the weights', so that part of them steps on the device
    o = {"none": 0.0, "some": w * rng.uniform(0.05, 0.95), "all": 1.0}[host_stepped]
    for dp in (1, 2, 4):
        _, step, st = _added_by(gpu, dp, params, offload_weights=w, offload_optimizer=o)
        d2h, h2d = _host_rates(st)
        stepped = params * np.where(ZERO_STAGES >= 1, 1 / dp, 1.0)
        own = stepped * (optimizer_step_s(st, o, w) - optimizer_step_s(st, 0.0))
        owners = ((ZERO_STAGES == 1) | (ZERO_STAGES == 2)) & (dp > 1)
        broadcast = np.where(owners, 2 * params * (min(o, w) / dp / h2d + w * (dp - 1) / dp / d2h), 0.0)
        np.testing.assert_allclose(step, own + broadcast, rtol=1e-9, atol=1e-15)


def test_gradient_accumulation_priced_as_the_engine_adds(rng):
    """Each micro-batch adds its weight gradients into the accumulated ones: a memory-bound add of
    the stage's gradients (ZeRO-2/3: this rank's shard) at the fitted residual-add line; Mist's
    runtime skips it on the first micro-batch, engines with a zeroed buffer (megatron-core) or an
    fp32 main_grad hook (Megatron-LM) pay it every time; gradients reduced as they are made
    (ZeRO-2/3 over more than one replica) have no buffer, so the first micro-batch's are kept and
    only the later ones add, in every engine. Negative control: an engine that adds nothing costs
    nothing more."""
    import dataclasses

    from mist.model.specs import GRAD_ACCUMULATION, GradAccumulation
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import SearchSpace, Setting, evaluate_stage, layer_numbers, strategy_grid

    gpu = str(rng.choice(["l4", "a10g", "a100-40gb"]))
    c, m = cluster(gpu, 8), model("gpt3-1.3b")
    dp, layers, g = int(rng.choice([1, 2, 4])), int(rng.integers(1, 7)), int(rng.integers(2, 40))
    free = GradAccumulation("none", 0.0, True)
    st = Setting(m, c, *cost_models(c), 1, dp, 1, 2, grad_accumulation=free)
    ln = layer_numbers(st)
    grid = strategy_grid(layers, SearchSpace(offload=False, recompute=False))
    first, last = bool(rng.integers(2)), bool(rng.integers(2))
    base = evaluate_stage(st, ln, layers, 1, first, last, grid, g)["compute"]
    add = st.runtime.curve("dropout_add")[0]
    edge = ln.embed_params * first + ln.head_params * last  # the head has no position table
    for acc in GRAD_ACCUMULATION.values():
        priced_st = dataclasses.replace(st, grad_accumulation=acc)
        priced = evaluate_stage(priced_st, ln, layers, 1, first, last, grid, g)["compute"]
        sharded = (grid["zero"] >= 2) & (dp > 1)
        grads = layers * ln.params + edge
        later = (g - 1) / g  # adds a micro-batch where the first does not add
        in_buffer = np.where(
            sharded, 0.0, (1.0 if acc.first_micro_batch else later) * add(acc.bytes_per_param * grads)
        )
        in_shards = np.where(sharded, later * add(acc.bytes_per_param * grads / dp), 0.0)
        np.testing.assert_allclose(priced - base, in_buffer + in_shards, rtol=1e-9)
        assert np.all(priced > base)
    assert GRAD_ACCUMULATION["mist"].adds_per_micro_batch(1) == 0.0  # one micro-batch: nothing to add


def test_serial_channels_take_turns(rng):
    """The CPU device's interference: channels started together finish after the sum of their solo
    times (one set of cores, synchronous collectives). Negative control: no interference, the max."""
    from mist.model.interference import Interference
    from mist.tuning.planner import load_interference

    times = rng.uniform(0, 1, (4, 5)) * (rng.uniform(size=(4, 5)) > 0.3)
    np.testing.assert_allclose(Interference.serial("test").overlap(*times), times.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(Interference().overlap(*times), times.max(axis=0))
    cpu = load_interference("cpu")
    np.testing.assert_allclose(cpu.overlap(*times), times.sum(axis=0), rtol=1e-12)


def test_llama_layers_priced_with_the_fitted_gated_excess(tmp_path):
    """A profile's plain Llama layer row (GATED_LAYER_OP, timed whole by `mist profile --tempo`)
    is fitted as what it measures beyond its ops' price (the lines fitted to the GPT-3 layer's ops,
    and the framework's): a line in the residual stream's bytes, the "gated" curve, added to every
    gated layer and to no other. Here the L4 profiles, each given that row at its price plus a
    known line: the fit recovers the line and GPT-3's layer costs what it did. Control: rows at
    their price less a margin (an excess below zero) add nothing."""
    import csv

    from mist.model.calibrate import calibrate
    from mist.model.profile_data import GATED_LAYER_OP, gated_layer, read_layer_profiles
    from mist.model.runtime import residual_stream_bytes

    source = tmp_path / "plain" / "l4"
    source.mkdir(parents=True)
    for f in (DATA / "gpu-op-profiles" / "l4").glob("*.csv"):
        (source / f.name).write_bytes(f.read_bytes())
    (before,) = calibrate(source).values()
    priced = before["model"]
    excess = (Line(30e-6, 80e9), Line(70e-6, 40e9))  # forward, backward
    gpt, llama = model("gpt3-1.3b", flash=False), model("llama-7b", flash=False)
    for name, shift in (("slower", excess), ("faster", None)):
        out = tmp_path / name / "l4"
        out.mkdir(parents=True)
        for f in source.iterdir():  # the collectives too; each layer file is rewritten below
            (out / f.name).write_bytes(f.read_bytes())
        for p in read_layer_profiles(source):
            layer = gated_layer(p.model)
            price = priced.layer_times(layer, p.mbs, p.seq, p.tp, weight_gradients=p.weight_gradients)
            work = residual_stream_bytes(layer, p.mbs, p.seq)
            times = [
                float(t) + (float(line(work)) if shift else -1e-4)
                for t, line in zip(price, excess, strict=True)
            ]
            path = source / f"gpt_{p.size}_mbs{p.mbs}_tp{p.tp}_algo{p.algo}.csv"
            with path.open() as fh:
                rows = list(csv.DictReader(fh))
            row = {**dict.fromkeys(rows[0], "0"), "op_name": GATED_LAYER_OP}
            row["forward-compute"], row["backward-compute"] = (f"{t * 1e6:.6f}" for t in times)
            with (out / path.name).open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows([*rows, row])
        (r,) = calibrate(out).values()
        rm = r["model"]
        assert rm.layer_times(gpt, 4, 1024, 2) == priced.layer_times(gpt, 4, 1024, 2)
        now, then = rm.layer_times(llama, 4, 1024, 2), priced.layer_times(llama, 4, 1024, 2)
        added = [a - b for a, b in zip(now, then, strict=True)]
        if shift:
            work = residual_stream_bytes(llama, 4, 1024)
            for got, line in zip(added, excess, strict=True):
                assert got == pytest.approx(float(line(work)), rel=1e-3)
        else:
            assert rm.curves["gated"] == (Line(0.0, None), Line(0.0, None)) and added == [0.0, 0.0]


def test_tempo_layers_priced_by_the_fitted_tempo_excess(tmp_path):
    """A profile's Tempo rows (the Tempo layer's time beyond the plain one, for the GPT-3 layer and
    for a Llama layer of its size) are each fitted as a line in the bytes Tempo's ops move in that
    layer (``tempo_work``) and added to a Tempo layer of that kind, and only to it. Here the L4
    profiles, each given Tempo rows made from known lines: the fit recovers them, prices a Tempo
    layer at its traced ops plus its kind's line, and leaves the plain layers as they were; the
    control: the same rows doubled double what the Tempo layers add."""
    import csv

    from mist.model.calibrate import calibrate
    from mist.model.profile_data import TEMPO_GATED_OP, TEMPO_OP, gated_layer, read_layer_profiles
    from mist.model.runtime import tempo_work

    # (forward, backward) lines, c0 s and bytes/s, for the GPT-3 layer and the Llama one
    lines = {
        TEMPO_OP: (Line(20e-6, 150e9), Line(50e-6, 60e9)),
        TEMPO_GATED_OP: (Line(5e-6, 400e9), Line(10e-6, 200e9)),
    }
    added = {}
    for scale in (1.0, 2.0):
        out = tmp_path / str(scale) / "l4"
        out.mkdir(parents=True)
        for f in (DATA / "gpu-op-profiles" / "l4").glob("*.csv"):
            (out / f.name).write_bytes(f.read_bytes())
        for p in read_layer_profiles(out):
            path = out / f"gpt_{p.size}_mbs{p.mbs}_tp{p.tp}_algo{p.algo}.csv"
            with path.open() as fh:
                rows = list(csv.DictReader(fh))
            for op, (fwd, bwd) in lines.items():
                layer = gated_layer(p.model) if op == TEMPO_GATED_OP else p.model
                work = tempo_work(layer, p.mbs, p.seq, p.tp)
                row = {**dict.fromkeys(rows[0], "0"), "op_name": op}
                row["forward-compute"], row["backward-compute"] = (
                    f"{scale * float(line(work)) * 1e6:.6f}" for line in (fwd, bwd)
                )
                rows.append(row)
            with path.open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        (r,) = calibrate(out).values()
        rm = r["model"]
        for op, plain in (
            (TEMPO_OP, model("gpt3-1.3b", flash=False)),
            (TEMPO_GATED_OP, model("llama-7b", flash=False)),
        ):
            lean = plain.with_(tempo=True)
            with_tempo, plain_before = rm.layer_times(lean, 4, 1024, 2), rm.layer_times(plain, 4, 1024, 2)
            curve = rm.curves.pop("tempo_gated" if plain.gated_mlp else "tempo")
            without = rm.layer_times(lean, 4, 1024, 2)
            assert rm.layer_times(plain, 4, 1024, 2) == plain_before  # a plain layer is not charged
            added[scale, op] = [a - b for a, b in zip(with_tempo, without, strict=True)]
            rm.curves["tempo_gated" if plain.gated_mlp else "tempo"] = curve
            if scale == 1.0:
                work = tempo_work(lean, 4, 1024, 2)
                for got, line in zip(added[scale, op], lines[op], strict=True):
                    assert got == pytest.approx(float(line(work)), rel=1e-4)
    for op in lines:
        for once, twice in zip(added[1.0, op], added[2.0, op], strict=True):
            assert twice == pytest.approx(2 * once, rel=1e-4)


@pytest.mark.parametrize("tempo", [False, True])
@pytest.mark.parametrize("gated_ffn", [None, 96])
def test_the_profile_times_the_layer_the_engine_trains(monkeypatch, tempo, gated_ffn):
    """The profile's whole-layer row (what the framework's and Tempo's excess are read from) times
    the layer mist.engine.run trains: every parameter in the profile's dtype. Negative control:
    megatron-core's local spec built the same way keeps its torch norms' weights in float32 (the
    profile timed that layer until 2026-12-05; the engine's half-precision wrapper casts them)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from mist.engine.profiler import layer as profiler_layer
    from mist.engine.profiler.megatron_layer import megatron_config, megatron_state

    timed = []
    built = profiler_layer.engine_layer

    def spy(*args, **kwargs):
        timed.append(built(*args, **kwargs))
        return timed[-1]

    monkeypatch.setattr(profiler_layer, "engine_layer", spy)
    seconds = profiler_layer.megatron_layer_seconds(
        1, 16, 64, 4, 1, torch.bfloat16, "cpu", repeats=1, tempo=tempo, gated_ffn=gated_ffn
    )
    assert len(timed) == 1 and all(t >= 0 for t in seconds)
    assert {p.dtype for p in timed[0].parameters()} == {torch.bfloat16}
    with megatron_state():
        local = build_module(
            get_gpt_layer_local_spec(), config=megatron_config(64, 4, 1, torch.bfloat16), layer_number=1
        )
    assert torch.float32 in {p.dtype for p in local.parameters()}


@pytest.mark.slow
def test_profile_with_company_leaves_no_process(tmp_path):
    """``concurrent=2`` on a CPU: a second copy of the profile competes for the cores while this
    one is measured (as a plan's two ranks do), and is gone when the profile is written."""
    import multiprocessing

    import torch

    from mist.engine.profiler import write_profiles
    from mist.model.profile_data import read_layer_profiles

    files = write_profiles(
        tmp_path, "cpu", 64, 4, 32, [1], [1], torch.float32, "cpu", repeats=2, concurrent=2
    )
    assert len(files) == 1 and read_layer_profiles(tmp_path)[0].layer_seconds > 0
    assert multiprocessing.active_children() == []
    for bad in ({"concurrent": 0}, {"rounds": 0}):
        with pytest.raises(ValueError, match="concurrent and rounds must be >= 1"):
            write_profiles(tmp_path, "cpu", 64, 4, 32, [1], [1], torch.float32, "cpu", **bad)


def test_profile_point_is_the_median_of_its_passes(tmp_path, monkeypatch, rng):
    """A slow stretch of the machine during one pass over the points moves that pass, not the
    written point: each op's time is the median over the passes. Negative control: with one pass
    the slow one is what is written."""
    import csv

    import torch

    from mist.engine import profiler
    from mist.engine.profiler import layer

    times = {op: rng.uniform(100.0, 1000.0, size=2) for op in ("enc-MLP-GEMM-1", "enc-MLP-gelu")}  # µs
    calls, slow = [], {}

    def rows(job, tp, b):
        factor = rng.uniform(1.5, 3.0) if len(calls) == slow["pass"] else rng.uniform(0.99, 1.01)
        calls.append(b)
        return [
            {"op_name": op, "forward-compute": f * factor, "backward-compute": w * factor, "weights": 1.0}
            for op, (f, w) in times.items()
        ]

    monkeypatch.setattr(layer, "_point_rows", rows)
    for rounds, slow["pass"] in ((3, int(rng.integers(3))), (1, 0)):
        calls.clear()
        out = tmp_path / f"rounds{rounds}"
        profiler.write_profiles(out, "cpu", 64, 4, 32, [2], [1], torch.float32, "cpu", rounds=rounds)
        assert calls == [2] * rounds
        with (out / "gpt_h64_mbs2_tp1_algo0.csv").open() as fh:
            written = {
                r["op_name"]: (float(r["forward-compute"]), float(r["backward-compute"]), r["weights"])
                for r in csv.DictReader(fh)
            }
        for op, expected in times.items():
            assert written[op][2] == "1.000"  # sizes carried, not medianed into something else
            error = max(abs(w / e - 1) for w, e in zip(written[op][:2], expected, strict=True))
            # the median of two near passes and a slow one: within their 1% (and the 3 decimals)
            assert error < 0.011 if rounds == 3 else error > 0.4, (rounds, op, written[op], expected)


def test_memory_bound_classes_fitted_to_profiles_of_shapes_within_the_cache(rng):
    """A profile of small shapes only (`mist profile` on a CPU at the shapes its plans run) has no
    op whose data exceeds the device's L2: its memory-bound classes are fitted to those times, not
    left to the data sheet's roofline. Here dropout is RNG-bound, ~10x slower than the bandwidth
    says, as on this project's CPU; where two ops exceed L2 (the GPU profiles) only they count."""
    from mist.model.calibrate import _profile_op_work, fit_runtime_model
    from mist.model.profile_data import LayerProfile
    from mist.model.runtime import OP_CLASS
    from mist.model.specs import gpus

    seconds_per_byte = rng.uniform(2e-9, 6e-9)  # ~0.25 GB/s: far below the nominal 20 GB/s
    profiles = []
    for mbs in (1, 2, 4):
        p = LayerProfile("cpu", "h256", mbs, 1, 0, {}, (256, 4, 4), 128, tp_comm_inside=False)
        ops = {}
        for op, cls in OP_CLASS.items():
            fwd, bwd = _profile_op_work(p.model, op, mbs, 128, 1)
            rate = seconds_per_byte if cls == "dropout" else 1e-11
            ops[op] = (1e-5 + fwd * rate, 1e-5 + bwd * rate)
        profiles.append(LayerProfile(**{**p.__dict__, "ops": ops}))
    work = _profile_op_work(profiles[-1].model, "enc-attention-dropout", 4, 128, 1)[0]
    assert work <= gpus()["cpu"].l2  # every sample within the cache: the case this covers
    rm = fit_runtime_model(profiles, {}, "cpu", "small shapes")
    fitted = float(rm.curve("dropout")[0](work))
    assert fitted == pytest.approx(1e-5 + work * seconds_per_byte, rel=1e-6)
    # negative control: the data sheet's roofline (what the class got before) is far off
    from mist.model.runtime import _roofline

    assert float(_roofline(gpus()["cpu"], "dropout")[0](work)) < 0.2 * fitted
    # a GPU's profiles of small shapes: its plans run larger ones, so the class keeps the roofline
    gpu_profiles = [LayerProfile(**{**p.__dict__, "gpu_dir": "l4"}) for p in profiles]
    on_gpu = fit_runtime_model(gpu_profiles, {}, "l4", "small shapes on a GPU")
    assert "dropout" not in on_gpu.curves


def test_a_gpu_profile_that_times_ops_faster_than_the_data_sheet_is_fitted_within_it(rng, monkeypatch):
    """`mist profile` on an H200 at the GPU check's shapes (GPT-3 1.3B, micro-batches 1, 2, 4): its
    memory-bound ops take a few microseconds each, two or three of them beyond L2 per class. Where
    their times say faster than the HBM's data-sheet bandwidth (noise, launch overhead), the fit
    ended with RateAbovePeakError and took both Mist parts of the GPU check with it; now each
    class is fitted within its peak. Control: the same profile's unbounded fit is refused."""
    from mist.model import calibrate
    from mist.model.calibrate import (
        WHOLE_LAYER_CLASSES,
        RateAbovePeakError,
        _profile_op_work,
        check_rates,
        fit_runtime_model,
    )
    from mist.model.profile_data import LayerProfile
    from mist.model.runtime import COMPUTE_KINDS, OP_CLASS
    from mist.model.specs import gpus

    spec, m = gpus()["h200"], model("gpt3-1.3b")
    overhead = rng.uniform(1e-5, 2e-5)  # a launch and a synchronising timer's, the first ones slower
    profiles = []
    for mbs in (1, 2, 4):
        p = LayerProfile("h200", "1.3b", mbs, 1, 0, {}, (m.hidden, m.layers, m.heads), m.seq, vocab=m.vocab)
        ops = {}
        for op, cls in OP_CLASS.items():
            if cls in WHOLE_LAYER_CLASSES:
                continue
            fwd, bwd = _profile_op_work(p.model, op, mbs, m.seq, 1)
            if cls in COMPUTE_KINDS:  # at 70% of the peak; a weight GEMM's backward is two GEMMs
                ops[op] = (overhead + fwd / (0.7 * spec.flops), overhead + 2 * fwd / (0.7 * spec.flops))
            else:  # each at 80-95% of the HBM, its overhead smaller the larger the micro-batch
                slower = {1: 2.0, 2: 1.0, 4: 0.5}[mbs] * overhead
                ops[op] = tuple(slower + w / (rng.uniform(0.8, 0.95) * spec.hbm_bw) for w in (fwd, bwd))
        profiles.append(LayerProfile(**{**p.__dict__, "ops": ops}))
    fitted = fit_runtime_model(profiles, {}, "h200", "faster than the data sheet", dtype="bf16")
    assert "; held at the data-sheet peak (times steeper than it, none faster): " in fitted.source
    for cls, lines in fitted.curves.items():
        if cls not in WHOLE_LAYER_CLASSES and cls not in COMPUTE_KINDS and cls != "wgrad":
            assert all(line.rate is not None and line.rate <= spec.hbm_bw * (1 + 1e-12) for line in lines), (
                cls
            )
    monkeypatch.setattr(calibrate, "class_peak", lambda gpu, cls, dtype: None)  # the control: unbounded
    unbounded = calibrate.RuntimeModel("h200", calibrate._fit_curves(profiles, "h200", "bf16"))
    monkeypatch.undo()
    with pytest.raises(RateAbovePeakError, match="above h200's data-sheet peak"):
        check_rates(unbounded, "bf16")


def test_cpu_profile_fits_each_tp_size_on_its_own(rng):
    """A CPU profile (`mist profile` at the very shapes its plans run) at TP 1 and 2, where an op
    at TP 2 takes longer than its TP-1 line at half the work (as on a 2-vCPU Xeon: one line
    through both sizes priced a TP-1 micro-batch 9% under): each size is priced by curves fitted
    to its own points, exactly as a fit to that size alone; a TP size not profiled by the curves
    through all. Negative control: the curves through both sizes price TP 1 off. A GPU's profiles
    keep one set of curves, and the per-size curves survive a preset's JSON."""
    from mist.model.calibrate import _profile_op_work, fit_runtime_model
    from mist.model.profile_data import EMBEDDING_OP, HEAD_OP, LayerProfile
    from mist.model.runtime import OP_CLASS, RuntimeModel
    from mist.model.symbolic import head_costs, value

    per_work = {1: rng.uniform(2e-12, 6e-12)}  # seconds per unit of work at TP 1
    per_work[2] = per_work[1] * rng.uniform(1.3, 1.8)  # TP 2's ops: less efficient per unit of work
    overhead = rng.uniform(5e-6, 2e-5)
    profiles = []
    for tp in (1, 2):
        for mbs in (1, 2, 4):
            p = LayerProfile("cpu", "h256", mbs, tp, 0, {}, (256, 4, 4), 128, tp_comm_inside=False, vocab=512)
            ops = {}
            for op in OP_CLASS:  # the layer's ops, the framework's excess, the gradient accumulation
                fwd, bwd = _profile_op_work(p.model, op, mbs, 128, tp)
                ops[op] = (overhead + fwd * per_work[tp], overhead + bwd * per_work[tp])
            edge = {k: value(e, p.model, mbs, 128, tp) for k, e in head_costs(p.model).items()}
            head = edge["head_flops_fwd"] + edge["logits_fp32_bytes"]  # the head's GEMM and its loss
            ops[HEAD_OP] = (overhead + head * per_work[tp], overhead + 2 * head * per_work[tp])
            ops[EMBEDDING_OP] = tuple(
                overhead + edge[k] * per_work[tp] for k in ("embed_tokens_bytes", "embed_table_bytes")
            )
            profiles.append(LayerProfile(**{**p.__dict__, "ops": ops}))
    m = profiles[0].model
    rm = fit_runtime_model(profiles, {}, "cpu", "both sizes")
    assert sorted(rm.tp_curves) == [1, 2]
    through_both = RuntimeModel("cpu", rm.curves, {}, "one line through both sizes")
    for tp in (1, 2):
        alone = fit_runtime_model([p for p in profiles if p.tp == tp], {}, "cpu", f"TP {tp} alone")
        assert alone.tp_curves == {}
        for mbs in (1, 3, 8):
            for times in ("layer_times", "head_times", "embedding_times"):
                assert getattr(rm, times)(m, mbs, 128, tp) == getattr(alone, times)(m, mbs, 128, tp), times
        assert rm.at_tp(tp).accumulate_line == alone.accumulate_line  # what stage_cost prices it by
    own, both = (sum(model.layer_times(m, 2, 128, 1)) for model in (rm, through_both))
    assert abs(both / own - 1) > 0.02, (both, own)  # the negative control
    assert through_both.accumulate_line != rm.at_tp(1).accumulate_line
    assert rm.layer_times(m, 2, 128, 4) == through_both.layer_times(m, 2, 128, 4)  # not profiled
    # the layer's ops alone (the edge rows' made-up rates would be above L4's data sheet)
    on_gpu = [
        LayerProfile(
            **{**p.__dict__, "gpu_dir": "l4", "ops": {k: v for k, v in p.ops.items() if k in OP_CLASS}}
        )
        for p in profiles
    ]
    assert fit_runtime_model(on_gpu, {}, "l4", "").tp_curves == {}
    again = RuntimeModel.from_json(rm.to_json())
    assert again.tp_curves == rm.tp_curves and again.layer_times(m, 2, 128, 2) == rm.layer_times(m, 2, 128, 2)
    for bad in ("0", "x", "02"):
        preset = {**rm.to_json(), "tp_curves": {bad: rm.to_json()["curves"]}}
        with pytest.raises(ValueError, match=rf"tp_curves: '{bad}' is not a TP size"):
            RuntimeModel.from_json(preset, "p.json")
    missing = {
        **rm.to_json(),
        "tp_curves": {"2": {k: v for k, v in rm.to_json()["curves"].items() if k != "gemm"}},
    }
    with pytest.raises(ValueError, match=r"p.json: tp_curves.2: missing gemm"):
        RuntimeModel.from_json(missing, "p.json")


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_priced_by_the_measured_layer_where_profiled(stage, rng):
    """Where `mist profile` measured ZeRO-2 or -3 as the engine runs it (on megatron-core's layer:
    ZeRO-3 FSDP2, ZeRO-2 the engine's reductions to each layer's owner; a line over the layer's
    weight bytes), a stage's layers at that ZeRO stage cost that, exposed (in compute), instead
    of their collectives on the overlappable channel, and so do its embedding and head (a unit
    each, by its own bytes: an FSDP2 unit, one more owner's bucket); other stages are priced as
    before. Negative control: without the measured line nothing changes."""
    import dataclasses

    from mist.model.runtime import ZERO2_LAYER, ZERO3_LAYER, Line
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import SearchSpace, Setting, evaluate_stage, layer_numbers, strategy_grid

    gpu = str(rng.choice(["l4", "a10g", "a100-40gb"]))
    c, m = cluster(gpu, 8), model("gpt3-1.3b")
    dp, layers, g = int(rng.choice([2, 4])), int(rng.integers(1, 7)), int(rng.integers(2, 40))
    st = Setting(m, c, *cost_models(c), 1, dp, 1, 2)
    ln = layer_numbers(st)
    grid = strategy_grid(layers, SearchSpace(offload=False, recompute=False))
    first, last = bool(rng.integers(2)), bool(rng.integers(2))
    base = evaluate_stage(st, ln, layers, 1, first, last, grid, g)
    line = Line(float(rng.uniform(1e-4, 1e-2)), float(rng.uniform(1e9, 1e11)))
    key = (ZERO2_LAYER if stage == 2 else ZERO3_LAYER, dp)
    rt = dataclasses.replace(st.runtime, collectives={**st.runtime.collectives, key: line})
    priced = evaluate_stage(dataclasses.replace(st, runtime=rt), ln, layers, 1, first, last, grid, g)
    at_stage = grid["zero"] == stage  # the embedding/head take their stage's strategy here
    # the embedding, the head: a module each (none in a middle stage), each by its own weight bytes
    # (the head has no position table)
    edge_units = [2.0 * ln.embed_params] * first + [2.0 * ln.head_params] * last
    units = [(layers, 2.0 * ln.params)] + [(1, full) for full in edge_units]
    np.testing.assert_allclose(
        priced["compute"] - base["compute"],
        np.where(at_stage, sum(n * float(line(full)) for n, full in units), 0.0),
        rtol=1e-9,
    )
    # ...and their collectives leave the overlappable channel (priced once, not twice): the
    # embedding's and head's as one, at their bytes together
    collectives = 0.0
    for n, full in [(layers, 2.0 * ln.params)] + ([(1, sum(edge_units))] if edge_units else []):
        one = rt.collective("reduce_scatter", full, dp, c)
        if stage == 3:
            one = one + 2 * rt.collective("all_gather", full, dp, c)
        collectives += n * float(one)
    np.testing.assert_allclose(
        base["g2g"] - priced["g2g"],
        np.where(at_stage, collectives, 0.0),
        rtol=1e-9,
        atol=1e-15,
    )
    np.testing.assert_array_equal(priced["steady"][~at_stage], base["steady"][~at_stage])
    np.testing.assert_array_equal(priced["memory"], base["memory"])
    measured = rt.zero2_layer if stage == 2 else rt.zero3_layer
    assert measured(1e6, dp) is not None and measured(1e6, dp, inter_node=True) is None
    assert st.runtime.zero2_layer(1e6, dp) is None and st.runtime.zero3_layer(1e6, dp) is None


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_benchmark_written_as_a_collective_and_fitted(tmp_path, stage):
    """`mist profile --collectives 2` also times ZeRO-2 and -3 as the engine runs them (on
    megatron-core's layer, 2 gloo processes) at the layer's size and half of it, in the
    collectives' file format, which calibrate fits into the line stage_cost prices such layers
    by. Other stages are refused before any process starts."""
    import torch

    from mist.engine.profiler import profile_zero_layers, write_zero_layers
    from mist.model.calibrate import fit_runtime_model
    from mist.model.profile_data import read_collectives
    from mist.model.runtime import ZERO2_LAYER, ZERO3_LAYER

    write_zero_layers(stage, tmp_path, 2, "cpu", 64, 4, 16, 1, torch.bfloat16, repeats=2, rounds=2)
    name = ZERO2_LAYER if stage == 2 else ZERO3_LAYER
    rows = read_collectives(tmp_path)[(name, 2)]
    (small, t_small), (large, t_large) = sorted(rows)
    assert (
        large == pytest.approx(2 * small, rel=0.05) and t_small >= 0 and t_large >= 0
    )  # 12h^2 x 2 B, halved
    rm = fit_runtime_model([], {(name, 2): rows}, "cpu", "test")
    measured = rm.zero2_layer if stage == 2 else rm.zero3_layer
    assert measured(large, 2) is not None and measured(large, 1) is None
    with pytest.raises(ValueError, match="stages 2 and 3"):
        profile_zero_layers(1, 2, "cpu", 64, 4, 16, 1, torch.bfloat16)


def test_tp_priced_by_the_measured_tp_layer_where_profiled(rng):
    """Where `mist profile` measured tensor parallelism as the engine runs it (megatron-core's layer
    split over the processes; lines over one all-reduce's bytes for the forward and for forward +
    backward), a layer's TP communication is those lines, forward (which recomputation repeats)
    and the rest backward, instead of back-to-back all-reduces; not under sequence parallelism
    (other collectives); a parallel block (one all-reduce each way) pays half. Negative control:
    lines measured for another TP size change nothing."""
    import dataclasses

    from mist.model.runtime import TP_LAYER, TP_LAYER_FORWARD
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import Setting, layer_numbers

    gpu = str(rng.choice(["l4", "a10g", "a100-40gb"]))
    c = cluster(gpu, 8)
    tp, b = int(rng.choice([2, 4])), int(rng.integers(1, 5))
    both = Line(float(rng.uniform(1e-3, 1e-2)), float(rng.uniform(1e9, 1e11)))
    share = float(rng.uniform(0.2, 0.8))  # of forward + backward, the forward's
    forward = Line(both.c0 * share, both.rate / share)
    for name, parallel_block in (("gpt3-1.3b", False), ("falcon-7b", True)):
        m = model(name)
        assert m.parallel_block == parallel_block
        for sp in (False, True):
            st = Setting(m, c, *cost_models(c), tp, 1, b, 2, sp=sp)
            base = layer_numbers(st)

            def priced(t: int, st=st):
                lines = {(TP_LAYER, t): both, (TP_LAYER_FORWARD, t): forward}
                rt = dataclasses.replace(st.runtime, collectives={**st.runtime.collectives, **lines})
                return layer_numbers(dataclasses.replace(st, runtime=rt)), rt

            assert priced(2 * tp)[0] == base  # measured for another TP size
            with_lines, rt = priced(tp)
            if sp:  # the benchmark's layer all-reduces: it does not price SP's collectives
                assert with_lines == base
                continue
            messages = 1 if parallel_block else 2
            message = 2.0 * b * m.seq * m.hidden  # the layer's [s, b, h] output, bf16
            comm_f = messages * float(forward(message)) / 2
            comm_b = messages * (float(both(message)) - float(forward(message))) / 2
            assert with_lines.tp_comm_fwd == pytest.approx(comm_f, rel=1e-9)
            assert with_lines.fwd - base.fwd == pytest.approx(comm_f - base.tp_comm_fwd, rel=1e-9, abs=1e-15)
            # backward's compute unchanged (without SP, backward's all-reduces mirror forward's)
            assert with_lines.bwd - comm_b == pytest.approx(base.bwd - base.tp_comm_fwd, rel=1e-9)
            assert with_lines.saved == base.saved and with_lines.params == base.params
    # one process, or across nodes: not measured, so the collectives price it
    assert rt.tp_layer(1e6, 1) is None and rt.tp_layer(1e6, tp, inter_node=True) is None


@pytest.mark.slow  # starts two gloo processes
def test_tp_benchmark_written_as_a_collective_and_fitted(tmp_path, rng):
    """`mist profile --collectives 2` also times TP as the engine runs it: megatron-core's layer
    split over 2 gloo processes against one rank's share alone, per micro-batch, by one
    all-reduce's bytes, forward + backward and the forward alone, in the collectives' file format,
    which calibrate fits into the lines layer_numbers prices TP layers by. Heads that do not split,
    or a single micro-batch (no line to fit), are refused before any process starts."""
    import torch

    from mist.engine.profiler import profile_tp_layers, write_tp_layers
    from mist.model.calibrate import fit_runtime_model
    from mist.model.profile_data import read_collectives
    from mist.model.runtime import TP_LAYER, TP_LAYER_FORWARD

    seq = int(rng.choice([8, 16]))
    micro_batches = sorted(rng.choice([1, 2, 3], size=2, replace=False).tolist())
    write_tp_layers(tmp_path, 2, "cpu", 64, 4, seq, micro_batches, torch.bfloat16, repeats=2, rounds=3)
    measured = read_collectives(tmp_path)
    rows = sorted(measured[(TP_LAYER, 2)])
    # (sizes are written in MB to 6 decimals)
    assert [size for size, _ in rows] == pytest.approx([2.0 * b * seq * 64 for b in micro_batches], rel=1e-3)
    # the seconds are a difference of two timings (~1 ms here): their sign is the machine's load,
    # not judged; what the model makes of either sign is (below)
    assert sorted(size for size, _ in measured[(TP_LAYER_FORWARD, 2)]) == [size for size, _ in rows]
    rm = fit_runtime_model([], measured, "cpu", "test")
    assert rm.tp_layer(rows[-1][0], 2) is not None and rm.tp_layer(rows[-1][0], 1) is None
    # negative added times (a loaded machine) are priced as no cost, never as a saving; the same
    # rows made positive (the control) are priced as a cost
    for sign in (-1, 1):
        timed = {
            key: [(size, sign * (abs(sec) + 1e-4)) for size, sec in pts] for key, pts in measured.items()
        }
        priced = fit_runtime_model([], timed, "cpu", "test").tp_layer(rows[-1][0], 2)
        assert all(((part == 0) if sign < 0 else (part > 0)).all() for part in priced), (sign, priced)
    with pytest.raises(ValueError, match="not a multiple"):
        profile_tp_layers(2, "cpu", 60, 3, seq, [1, 2], torch.bfloat16)
    with pytest.raises(ValueError, match="two or more"):
        profile_tp_layers(2, "cpu", 64, 4, seq, [2, 2], torch.bfloat16)


def test_benchmark_launches_combined_by_the_median_of_each_time(rng):
    """A benchmark repeated over launches (gloo's latency mode is set per launch on a CPU): each
    row keeps its size and takes the median of each of its times across launches; rows of
    different counts are refused, and so is no launch at all."""
    from mist.engine.profiler.ranks import median_rows, run_ranks

    sizes = sorted(rng.choice(1 << 20, size=3, replace=False).tolist())
    launches = [
        [(b, *rng.uniform(1e-4, 1e-2, size=2)) for b in sizes] for _ in range(int(rng.choice([3, 5])))
    ]
    combined = median_rows(launches)
    assert [row[0] for row in combined] == sizes
    for i, row in enumerate(combined):
        for k in (1, 2):
            assert row[k] == pytest.approx(float(np.median([launch[i][k] for launch in launches])))
    # negative control: one launch far off moves a mean, not the median
    launches[0][0] = (sizes[0], 1.0, 1.0)
    assert median_rows(launches)[0][1] < 0.1
    with pytest.raises(ValueError):
        median_rows([launches[0], launches[1][:2]])
    with pytest.raises(ValueError, match="at least 1"):
        run_ranks(print, 2, (), 0)


@pytest.mark.parametrize("flash", [False, True])
def test_selective_recomputation_keeps_less_and_repeats_the_core_attention(flash):
    """What selective recomputation frees per layer and micro-batch is Korthikanti et al.'s
    5 a s^2 b bytes (the softmax's output, the dropout's mask and output; TP 1), and with
    FlashAttention, which keeps no scores, only its fp32 log-sum-exp (4 a s b). A stage keeps that
    much less per layer not fully recomputed and micro-batch in flight, and each such layer repeats
    its core attention's forward."""
    from mist.tuning.planner import cost_models
    from mist.tuning.stage_cost import Setting, evaluate_stage, layer_numbers

    m, c = model("gpt3-1.3b", flash=flash), cluster("l4", 8)
    b, s, a = 2, m.seq, m.heads
    st = Setting(m, c, *cost_models(c), 1, 1, b, 4)
    ln = layer_numbers(st)
    assert ln.saved - ln.selective_saved == (4 * a * s * b if flash else 5 * a * s * s * b)
    assert ln.core_fwd > 0
    layers, r = 6, 2
    values = []
    for selective in (0.0, 1.0):
        grid = {
            k: np.array([0.0])
            for k in ("zero", "offload_weights", "offload_grads", "offload_optimizer", "offload_activations")
        }
        grid.update(recompute=np.array([float(r)]), selective=np.array([selective]))
        values.append(evaluate_stage(st, ln, layers, 3, False, False, grid, 8))
    plain, selective = values
    kept_less = (layers - r) * (ln.saved - ln.selective_saved)
    assert plain["per_flight"][0] - selective["per_flight"][0] == pytest.approx(kept_less)
    assert selective["compute"][0] - plain["compute"][0] == pytest.approx((layers - r) * ln.core_fwd)


def test_a_layers_backward_is_priced_above_what_it_keeps():
    """stage_cost's layer backward on stated numbers, one grid row per case: a kept layer adds
    its peak op's excess over what it keeps (under selective recomputation the selective excess,
    only where the stage keeps a layer), a recomputed one its activations made again too, and
    the residual stream's gradient either way; under ZeRO-3 the end of the layer (its gradients
    and the reduce-scatter input, what it kept freed) where that is larger. Controls: the
    selective excess where every layer is recomputed, and the plain excess under selective
    recomputation, give other numbers."""
    from mist.model.specs import GRAD_ACCUMULATION
    from mist.tuning.stage_cost import LayerNumbers, _layer_backward_peak, _sharded_grads_end_bytes

    numbers = {"saved": 1000.0, "selective_saved": 600.0, "backward_excess": 70.0}
    layer = LayerNumbers(
        fwd=1.0, bwd=2.0, selective_backward_excess=300.0, core_fwd=0.5, layer_input=10.0, params=50.0,
        tp_comm_fwd=0.0, p2p_bytes=0.0, p2p=0.0, **numbers,
    )  # fmt: skip

    def grid(recompute, selective, zero):
        return {
            "recompute": np.array([recompute]),
            "selective": np.array([selective]),
            "zero": np.array([zero]),
        }

    def peak(recompute, selective, zero=0, recomputed=False, weights=0.0):
        end = _sharded_grads_end_bytes(GRAD_ACCUMULATION["megatron-core"], zero, weights, own=2.0)
        return float(_layer_backward_peak(layer, grid(recompute, selective, zero), 4, end, recomputed)[0])

    assert peak(0, 0) == 70 + 10
    assert peak(1, 1) == 300 + 10 != 70 + 10
    assert peak(4, 1) == 70 + 10 != 300 + 10  # no layer kept: no selective one
    assert peak(1, 0, recomputed=True) == 1000 + 70 + 10
    # ZeRO-3: 2 x 400 B of gradients at the end, the 1000 B it kept freed (600 under selective)
    assert peak(0, 0, zero=3, weights=400.0) == 70 + 10
    assert peak(0, 1, zero=3, weights=400.0) == 300 + 10 + 800 - 600
    assert peak(0, 0, zero=3, weights=1000.0) == 70 + 10 + 2000 - 1000
