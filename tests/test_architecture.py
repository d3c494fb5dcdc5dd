"""Layering: no import cycles among the project's modules, the shared layers know nothing of the
systems above them, and the planner's command line loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# importable roots: the library packages under impl/, the experiment and baseline packages at the top
ROOTS = {REPO / "impl": None, REPO: ("artifacts", "baselines")}


def _modules() -> dict[str, Path]:
    out = {}
    for base, only in ROOTS.items():
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if (only is not None and parts[0] not in only) or ".nox" in parts:
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (function-level imports too), with the
    packages whose ``__init__`` that runs, but not its own ancestors (already running)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            targets += [module, *(f"{module}.{a.name}" for a in node.names)]
    out = set()
    for target in targets:
        while target:
            if target in modules and target != name and not name.startswith(target + "."):
                out.add(target)
            target = target.rpartition(".")[0]
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    """Negative control: a made-up back edge is reported."""
    graph = _graph()
    graph["tempo.gelu_math"] = graph["tempo.gelu_math"] | {"tempo.kernels.gelu"}
    assert ["tempo.gelu_math", "tempo.kernels.gelu"] in _cycles(graph)


def test_measure_knows_nothing_of_the_systems():
    """The shared measurement layer imports no system package; callers pass what it needs."""
    graph = _graph()
    systems = ("tempo", "mist", "ctapipe", "artifacts", "baselines")
    leaks = {
        m: sorted(t for t in graph[m] if t.split(".")[0] in systems) for m in graph if m.startswith("measure")
    }
    assert {m: t for m, t in leaks.items() if t} == {}


def test_planning_loads_no_torch():
    """Neither a plain plan nor one of Tempo's layers with their unfused attention core, which
    the planner prices with tempo.sizes."""
    code = (
        "import sys; from mist.__main__ import main; "
        "main(['plan', '--model', 'gpt3-1.3b', '--gpus', '8', '--gpu', 'l4', '--global-batch', '8', "
        "'--quiet']); "
        "main(['plan', '--model', 'gpt3-1.3b', '--gpus', '8', '--gpu', 'l4', '--global-batch', '8', "
        "'--quiet', '--tempo', '--no-flash']); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# Mist's layers, lowest first: the cost model, the plan format, the search, the engine; the package
# itself and its command line sit on top.
MIST_LAYERS = ("mist.model", "mist.plan", "mist.tuning", "mist.engine", "mist")


def _mist_layer(module: str) -> int:
    return next(i for i, layer in enumerate(MIST_LAYERS) if module == layer or module.startswith(layer + "."))


def _upward_mist_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    out = {}
    for name, targets in graph.items():
        if name.split(".")[0] != "mist":
            continue
        up = sorted(t for t in targets if t.split(".")[0] == "mist" and _mist_layer(t) > _mist_layer(name))
        if up:
            out[name] = up
    return out


def test_mist_layers_import_only_downward():
    assert _upward_mist_imports(_graph()) == {}


def test_an_upward_mist_import_is_found():
    """Negative control: the cost model importing the search is reported."""
    graph = _graph()
    graph["mist.model.runtime"] = graph["mist.model.runtime"] | {"mist.tuning.planner"}
    assert _upward_mist_imports(graph) == {"mist.model.runtime": ["mist.tuning.planner"]}


# Every preset's cached reader (the data sheets, Mist's models and clusters, Tempo's models, the
# latency model's hardware built from the sheets): a preset file is read on first use, never at import
_PRESET_READERS = (
    "measure.datasheets:datasheets",
    "mist.model.specs:_model_presets",
    "mist.model.specs:_cluster_presets",
    "tempo.models:models",
    "ctapipe.sim:hardware_presets",
)


def _preset_reads(then: str = "") -> list[int]:
    """How many times each reader in _PRESET_READERS has read, in a fresh interpreter that imports
    every module that holds or uses a preset (and runs ``then``)."""
    code = (
        "import importlib, sys\n"
        "import mist, mist.__main__, mist.plan, mist.model.calibrate, mist.model.runtime\n"
        "import mist.tuning.planner, artifacts.smoke, artifacts.cta_mlp.gpu, artifacts.tempo_llama.run\n"
        "import tempo.models, tempo.maxbatch, ctapipe.sim, artifacts.cta_mlp.run, artifacts.tempo_bert.run\n"
        f"{then}\n"
        f"readers = [r.split(':') for r in {list(_PRESET_READERS)!r}]\n"
        "print([getattr(importlib.import_module(m), f).cache_info().misses for m, f in readers])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_no_preset_file_is_read_at_import():
    assert _preset_reads() == [0] * len(_PRESET_READERS)


def test_a_preset_read_is_counted():
    """Control: the count above sees a read (one each, then cached)."""
    then = "mist.cluster('l4', 8); mist.model('gpt3-7b'); tempo.models.models(); ctapipe.sim.hardware('h200')"
    assert _preset_reads(then) == [1] * len(_PRESET_READERS)
