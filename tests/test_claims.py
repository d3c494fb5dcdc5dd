"""The claims registry: the README's table is generated from it, the committed reference passes
it, and a claim outside its tolerance fails the check."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from artifacts import claims
from artifacts.claims import CLAIMS, AtLeast, AtMost, Near, Timing, evaluate, markdown, readme_table


def test_readme_claims_table_is_the_registry():
    assert readme_table() == markdown(), "README drifted: run `python -m artifacts.claims --write-readme`"


def test_every_cpu_claim_has_a_reference_and_the_reference_passes():
    rows = evaluate(run_source="reference")
    missing = [r.claim.id for r in rows if not r.claim.gpu and r.reference is None]
    assert not missing, f"CPU claims without a committed reference result: {missing}"
    assert not [r.claim.id for r in rows if r.verdict == "OUTSIDE"]
    # a claim marked as known to be outside is: the mark goes when its cause is fixed
    assert not [r.claim.id for r in rows if r.claim.known_outside and r.verdict != "OUTSIDE (known)"]
    assert len({c.id for c in CLAIMS}) == len(CLAIMS), "claim ids must be unique"


def test_checks():
    ref = random.uniform(-10, 10)
    near = Near(abs=0.5, rel=0.1)
    slack = 0.5 + 0.1 * abs(ref)
    assert near.ok(ref + 0.99 * slack, ref) and near.ok(ref - 0.99 * slack, ref)
    assert not near.ok(ref + 1.01 * slack, ref) and not near.ok(ref - 1.01 * slack, ref)
    assert near.ok(ref, None) is None  # no reference: cannot be judged
    assert Near().ok(ref, ref) and not Near().ok(ref + 1e-9, ref)
    bound = random.uniform(0, 1)
    assert AtMost(bound).ok(bound, None) and not AtMost(bound).ok(bound * 1.001 + 1e-12, None)
    assert AtLeast(bound).ok(bound, None) and not AtLeast(bound).ok(bound * 0.999 - 1e-12, None)
    assert Timing().ok(ref, ref) is None


@pytest.fixture
def copied_artifacts(tmp_path, monkeypatch):
    """A copy of the committed references as both reference and this run's results."""
    for experiment in {c.experiment for c in CLAIMS}:
        ref = claims.ARTIFACTS / experiment / "reference"
        if ref.is_dir():
            shutil.copytree(ref, tmp_path / experiment / "reference")
            shutil.copytree(ref, tmp_path / experiment / "results")
    monkeypatch.setattr(claims, "ARTIFACTS", tmp_path)
    return tmp_path


def test_a_claim_outside_its_tolerance_fails_the_check(copied_artifacts, capsys):
    assert claims.main([]) == 0
    claim = next(c for c in CLAIMS if c.id == "tempo-layer-512")
    path = copied_artifacts / claim.experiment / "results" / claim.file
    path.write_text(path.read_text().replace('"variant": "tempo"', '"variant": "renamed"'))
    assert claims.main(["tempo_layer"]) == 0  # a point missing: the claim was not run, not outside
    assert "not run" in capsys.readouterr().out
    shutil.copy(copied_artifacts / claim.experiment / "reference" / claim.file, path)
    text = path.read_text()
    before = claim.read("results")
    # one byte count scaled up by a random factor: the saving moves well beyond its 0.1-point tolerance
    factor = random.uniform(1.2, 1.5)
    data = json.loads(text)
    for p in data["points"]:
        if p["key"] == {"layer": "bert-large", "seq": 512, "batch": 1, "dtype": "bf16", "variant": "tempo"}:
            p["result"]["bytes"] = int(p["result"]["bytes"] * factor)
    path.write_text(json.dumps(data))
    assert claim.read("results") < before - 0.01
    assert claims.main(["tempo_layer"]) == 1
    assert "OUTSIDE" in capsys.readouterr().out


def test_unknown_experiment_is_refused(capsys):
    with pytest.raises(SystemExit):
        claims.main(["tempo_bertt"])
    assert "accepted: " in capsys.readouterr().err


def test_welch_interval_matches_scipy():
    from scipy import stats

    from artifacts.tempo_bert.summary import welch_interval

    a = [random.gauss(7.19, 0.01) for _ in range(random.randint(3, 20))]
    b = [random.gauss(7.19 + random.uniform(-0.02, 0.02), random.uniform(0.005, 0.03)) for _ in range(10)]
    low, high = welch_interval(a, b, 0.90)
    ref = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
    assert low == pytest.approx(ref.low, rel=1e-9, abs=1e-12) and high == pytest.approx(
        ref.high, rel=1e-9, abs=1e-12
    )
