"""The package's modules form one-way layers: each imports (at module level or inside functions) only modules of
lower layers, so a reader finds where a strategy is defined (_strategies), how it is decided (_decide, pure; _auto
around it) and what moves the rows (_kernels)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pytorch_direct

PACKAGE = Path(pytorch_direct.__file__).parent
# Lowest first. Compiled and shared helpers are the floor.
LAYERS = [
    ("_core", "_shared_cuda"),
    ("_config",),
    ("_memory",),     # host memory the GPU can read, as plain tensors
    ("_kernels",),    # the primitives that move rows (launches, sorting, staged pipeline, checks)
    ("_cell", "_cache"),  # typed values auto decides over; the GPU cache of hot rows
    ("_strategies",),  # the strategy registry: one type per strategy, and running a decided plan
    ("_features", "_decide", "_cells"),  # index features; the pure decision; the cell store (on disk)
    ("_measure",),    # racing candidates, judging host plans in use, calibration
    ("_auto",),       # auto in this process: features per call kind, decide, measure, record
    ("_ops",),        # custom ops + autograd: decide, then run
    ("_tensor",),     # the UnifiedTensor subclass
    ("_create", "_sample_script", "_sample_cuda"),  # public factories; the sampler's homogeneous batch as one
    # TorchScript function, and as the package's CUDA kernels
    ("_sharing", "_sample"),  # _sample: the neighbour sampler
    ("_topology",),   # PyG data and stores taken apart for the sampler
    ("pyg",),
    ("_epoch",),      # one epoch of the loader: its threads, queues and CUDA events
    ("_loader",),     # the mini-batch loader
    ("sampling",),    # public face of the sampler and loader
    ("__init__",),
    ("__main__",),
]
LAYER_OF = {name: k for k, names in enumerate(LAYERS) for name in names}


def package_imports(path: Path) -> set[str]:
    """Modules of this package that `path` imports anywhere (relative or absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import a, b
                found.update(alias.name for alias in node.names)
            elif node.level == 1:  # from .a import x
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.startswith("pytorch_direct"):
                parts = node.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else (a.name for a in node.names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "pytorch_direct" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules <= set(LAYER_OF), f"put {sorted(modules - set(LAYER_OF))} into LAYERS"


@pytest.mark.parametrize("module", sorted(p.stem for p in PACKAGE.glob("*.py")))
def test_imports_go_down_only(module):
    imports = package_imports(PACKAGE / f"{module}.py")
    if module == "__main__":
        imports.discard("__version__")  # the top reads the version from the package root
    unknown = sorted(imports - set(LAYER_OF))
    assert not unknown, f"{module} imports {unknown} from the package root or an unlisted module"
    upward = sorted(name for name in imports if LAYER_OF[name] >= LAYER_OF[module] and name != module)
    assert not upward, f"{module} (layer {LAYER_OF[module]}) imports {upward} from its own layer or above"


def test_the_checker_sees_lazy_and_absolute_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from . import _a, _b\nfrom ._c import x\nimport pytorch_direct._d\n"
                      "def f():\n    from pytorch_direct import _e\n    from pytorch_direct._f import y\n")
    assert package_imports(source) == {"_a", "_b", "_c", "_d", "_e", "_f"}


def test_the_decision_is_pure():
    # decide() reads typed values only: its module imports no torch, no compiled core, nothing that measures or
    # stores (a decision can be tested and reasoned about without a GPU or a file).
    imports = package_imports(PACKAGE / "_decide.py")
    assert imports <= {"_cell", "_strategies"}, imports
    source = (PACKAGE / "_decide.py").read_text()
    assert "import torch" not in source and "_core" not in source


def test_strategy_names_live_in_the_registry_only():
    # A strategy name spelled out as a string appears in the registry module and in the built-in rules (which name
    # the strategies they pick), nowhere else in the package.
    import re

    from pytorch_direct._strategies import REGISTRY

    for path in PACKAGE.glob("*.py"):
        if path.stem in ("_strategies", "_decide"):
            continue
        text = path.read_text()
        for name in REGISTRY:
            if name in ("vector", "sorted", "staged", "cached", "naive"):
                continue  # (ordinary words in prose and in other APIs, e.g. torch.unique(sorted=True))
            assert not re.search(rf"[\"']{name}[\"']", text), f"{path.name} spells strategy {name!r}"


def test_lower_layers_import_without_the_tensor_subclass():
    # Loading the decision layers (and everything below them) defines neither UnifiedTensor nor the custom ops.
    code = (
        "import importlib.util, sys, types\n"
        f"root = {str(PACKAGE)!r}\n"
        "pkg = types.ModuleType('pytorch_direct'); pkg.__path__ = [root]; pkg.__version__ = '0'\n"
        "sys.modules['pytorch_direct'] = pkg\n"
        "import pytorch_direct._auto\n"
        "assert 'pytorch_direct._tensor' not in sys.modules and 'pytorch_direct._ops' not in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
