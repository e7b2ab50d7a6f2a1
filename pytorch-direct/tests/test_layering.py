"""The package's modules form one-way layers: each imports (at module level or inside functions) only modules of
lower layers, so a reader finds where a strategy is decided (_strategy) and where it is executed (_kernels)."""

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
    ("_kernels",),    # executing a decided plan
    ("_strategy",),   # deciding a plan (measuring, cache, rules)
    ("_ops",),        # custom ops + autograd: decide, then execute
    ("_tensor",),     # the UnifiedTensor subclass
    ("_create",),     # public factories
    ("_sharing", "_sample"),  # _sample: the neighbour sampler
    ("_topology",),   # PyG data and stores taken apart for the sampler
    ("pyg",),
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


def test_lower_layers_import_without_the_tensor_subclass():
    # Loading the decision layer (and everything below it) defines neither UnifiedTensor nor the custom ops.
    code = (
        "import importlib.util, sys, types\n"
        f"root = {str(PACKAGE)!r}\n"
        "pkg = types.ModuleType('pytorch_direct'); pkg.__path__ = [root]; pkg.__version__ = '0'\n"
        "sys.modules['pytorch_direct'] = pkg\n"
        "import pytorch_direct._strategy\n"
        "assert 'pytorch_direct._tensor' not in sys.modules and 'pytorch_direct._ops' not in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
