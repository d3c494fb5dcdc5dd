"""The baselines CTA-pipelining is compared against compute the same chain as plain PyTorch."""

from __future__ import annotations

import json

import pytest
import torch

from baselines.cta.single_gpu import MicrobatchedMLP, back_to_back_mlp
from baselines.cta.tensor_parallel import shard_chain
from ctapipe.reference import activation, chain
from ctapipe.sim import candidate_chunks
from measure.launch import run_torchrun


def test_single_device_baselines_match_the_reference():
    m, d, f = 64, int(torch.randint(8, 40, ())), int(torch.randint(8, 40, ()))
    x, w1, w2 = torch.randn(m, d), torch.randn(d, f), torch.randn(f, d)
    ref = chain(x, [w1, w2], ["gelu", "none"])
    torch.testing.assert_close(back_to_back_mlp(x, w1, w2, "gelu"), ref)
    for c in (64, 32, 16):
        torch.testing.assert_close(MicrobatchedMLP(c, "gelu")(x, w1, w2), ref)
    with pytest.raises(ValueError, match="must divide M=64"):
        MicrobatchedMLP(24, "gelu")(x, w1, w2)


def test_tp_shards_rebuild_the_layers():
    weights = [torch.randn(8, 12), torch.randn(12, 8), torch.randn(8, 16)]
    shards = [shard_chain(weights, r, 4) for r in range(4)]
    for i, w in enumerate(weights):
        torch.testing.assert_close(torch.cat([s[i] for s in shards], dim=1 if i % 2 == 0 else 0), w)
    with pytest.raises(ValueError, match="must divide by TP size 5"):
        shard_chain(weights, 0, 5)
    with pytest.raises(ValueError, match="activation 'tanh' unknown"):
        activation(torch.zeros(1), "tanh")


def test_candidate_chunks():
    assert candidate_chunks(1024, 128) == [1024, 512, 256, 128]
    assert candidate_chunks(96, 128) == [96]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_baselines_on_two_gloo_processes(tmp_path):
    """The torchrun driver: back-to-back, every micro-batch chunk and TP over a 2-layer chain;
    it raises when any output differs from the reference, so a clean exit is the check."""
    out = tmp_path / "r.json"
    flags = [
        "--rows",
        "256",
        "--width",
        "32",
        "--dtype",
        "fp32",
        "--repeats",
        "1",
        "--smallest-chunk",
        "64",
        "--out",
        str(out),
    ]
    done = run_torchrun(2, "artifacts.cta_mlp.distributed", flags, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"back_to_back", "microbatch_128", "microbatch_64", "tp"}
    assert all(r["error"] < 1e-5 and r["latency_s"] > 0 for r in report["methods"].values())


class _Launched(Exception):
    """The driver got past its checks to the launch (the control's stop)."""


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        # run as a plain script: a 20-line traceback naming RANK, not torchrun (probe round 5 F37)
        ({"RANK": None}, [], "no RANK in the environment: launch it with torchrun --nproc-per-node N"),
        ({"RANK": "abc"}, [], "RANK='abc' must be a whole number"),
        ({}, ["--rows", "0"], "--rows must be at least 1, got 0"),  # was unchecked
        ({}, ["--smallest-chunk", "-4"], "--smallest-chunk must be at least 1, got -4"),
        ({}, ["--out", "{tmp}"], "a folder; give the file's name"),
    ],
)
def test_distributed_driver_refuses_bad_launches_in_one_line(
    tmp_path, monkeypatch, capsys, env, argv, message
):
    """As `mist.engine.run`: one line, exit 2, before any process group. Control: the accepted
    launch gets past the checks."""
    from artifacts.cta_mlp import distributed

    def launched() -> None:
        raise _Launched

    monkeypatch.setattr(distributed, "die_with_launcher", launched)  # never this process's fate
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "1", **env}.items():
        monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        distributed.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(_Launched):  # control
        distributed.main(["--rows", "64", "--out", str(tmp_path / "r.json")])
