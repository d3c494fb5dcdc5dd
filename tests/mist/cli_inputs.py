"""What the Mist command-line tests share: a small plan file, a quick `mist profile` command line,
and the check that a refusal is one line."""

from __future__ import annotations

# a 24-layer GPT-3 1.3B over two pipeline stages on two L4s: `mist predict` prices it in well under
# a second
PLAN = """model: gpt3-1.3b
gpu: l4
gpus: 2
gpus_per_node: 8
global_batch: 8
tp: 1
dp: 1
micro_batch: 1
stages: [{layers: 12}, {layers: 12}]
"""


def profile_argv(*micro_batches: int) -> list[str]:
    """`mist profile` of a tiny layer on the CPU (hidden 64, 4 heads, seq 16, one repeat), without
    its --out."""
    sizes = ["--hidden", "64", "--heads", "4", "--seq", "16"]
    return ["profile", "--name", "cpu", *sizes, "--micro-batches", *map(str, micro_batches), "--repeats", "1"]


def one_error_line(err: str, *expected: str) -> None:
    """``err`` (a command's stderr) is one line, no traceback, holding each of ``expected``."""
    err = err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
