"""Megatron-LM's own argument checks on a command from ``mist export --to megatron-lm``.

Megatron-LM's training code (``megatron/training``) is not on PyPI (the ``megatron-core`` wheel
holds ``megatron/core`` only), so the check needs a checkout at the release of the pinned
megatron-core (tag ``core_v0.16.1``), named by the ``MEGATRON_LM`` environment variable; it also
imports ``six``. Its ``parse_args`` reads the command's arguments and its ``validate_args`` applies
every rule it has; megatron-core's TransformerConfig and OptimizerConfig, built from the arguments as
Megatron-LM builds them, apply theirs (an AssertionError or ValueError names what is refused).

The check stands in for the machine the command would run on, whose GPU and Transformer Engine
this one may lack: ``validate_args`` asks the GPU's architecture (TP needs
CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell), answered for the plan's GPU type; megatron-core's
TransformerConfig asks for Transformer Engine's version and its fused rotary kernel (Megatron-LM
fuses rotary embeddings by default), answered as present (TE 2.x).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

PINNED_CORE = "0.16.1"
# Compute capability major of each GPU preset (data sheets): what validate_args asks the device
ARCH = {"l4": 8, "a10g": 8, "v100": 7, "a100-40gb": 8, "h100": 9, "h200": 9, "cpu": 9}


def megatron_lm_checkout() -> Path | None:
    """The checkout named by MEGATRON_LM (None: unset). Raises ValueError if it is not one."""
    root = os.environ.get("MEGATRON_LM")
    if not root:
        return None
    path = Path(root)
    if not (path / "megatron" / "training" / "arguments.py").is_file():
        raise ValueError(
            f"MEGATRON_LM={root}: no megatron/training/arguments.py there (a Megatron-LM checkout)"
        )
    info = path / "megatron" / "core" / "package_info.py"
    if info.is_file():  # read, not run: its MAJOR = 0, MINOR = 16, PATCH = 1 lines
        text = info.read_text()
        version = ".".join(
            (re.search(rf"^{name} = (\d+)$", text, re.MULTILINE) or ["", "?"])[1]
            for name in ("MAJOR", "MINOR", "PATCH")
        )
        if version != PINNED_CORE:
            raise ValueError(f"MEGATRON_LM={root} is megatron-core {version}; the pin is {PINNED_CORE}")
    return path


def split_command(command: str) -> tuple[dict[str, str], int, list[str]]:
    """(environment assignments, processes in all, the training script's argv) of an exported
    command: ``[VAR=value ...] torchrun --nnodes N --nproc-per-node G ... script args``."""
    words = shlex.split(command.replace("\\\n", " "), posix=True)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[0] == "torchrun", words[:3]
    nodes = int(words[words.index("--nnodes") + 1])
    per_node = int(words[words.index("--nproc-per-node") + 1])
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return env, nodes * per_node, words[script + 1 :]


def _te_kernel(*args, **kwargs):
    raise RuntimeError("a stand-in for Transformer Engine's kernel: the check never runs a model")


def validate(command: str, gpu: str, checkout: Path) -> str | None:
    """None if Megatron-LM's parse_args and validate_args accept the exported ``command`` for a
    plan on ``gpu``; else the first line of what they raised."""
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import optimizer_config
    from megatron.core.transformer import transformer_config
    from megatron.training import arguments
    from megatron.training.training import get_megatron_optimizer_config

    env, world, argv = split_command(command)
    saved_env, saved_argv = dict(os.environ), sys.argv
    te_users = (transformer_config, optimizer_config)  # the configs that ask for TE's version
    arch, te_version = arguments.get_device_arch_version, transformer_config.is_te_min_version
    fused_rope = rope_utils.fused_apply_rotary_pos_emb
    try:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # only what the command sets
        os.environ.update(env, WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
        sys.argv = ["pretrain_gpt.py", *argv]
        arguments.get_device_arch_version = lambda: ARCH[gpu]
        for module in te_users:
            module.is_te_min_version = lambda version, check_equality=True: version.startswith(("1.", "2."))
        rope_utils.fused_apply_rotary_pos_emb = fused_rope or _te_kernel
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 prints every argument
            args = arguments.parse_args()
            arguments.validate_args(args)
            arguments.core_transformer_config_from_args(args)
            get_megatron_optimizer_config(args)
    except (AssertionError, ValueError, RuntimeError, SystemExit) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        arguments.get_device_arch_version = arch
        for module in te_users:
            module.is_te_min_version = te_version
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return None
