"""Every public function and public method of a public class carries type hints (parameters and return), the
package ships py.typed, and every option of a benchmark CLI has --help text."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FOLDER = {"pytorch_direct": "pytorch-direct", "hector": "hector", "ssdtrain": "ssdtrain"}
PUBLIC_MODULES = {"pytorch_direct": ["pytorch_direct", "pytorch_direct.sampling"], "hector": ["hector", "hector.nn"],
                  "ssdtrain": ["ssdtrain"]}


def _untyped(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    found = []
    for attr in getattr(module, "__all__", []):
        obj = getattr(module, attr, None)
        targets = []
        if inspect.isfunction(obj):
            targets.append((f"{module_name}.{attr}", obj))
        elif inspect.isclass(obj) and obj.__module__.startswith(module_name.split(".")[0]):
            for name, member in vars(obj).items():
                if inspect.isfunction(member) and (not name.startswith("_") or name == "__init__"):
                    targets.append((f"{module_name}.{attr}.{name}", member))
        for qualified, function in targets:
            signature = inspect.signature(function)
            missing = [p.name for p in signature.parameters.values()
                       if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
            if function.__name__ != "__init__" and signature.return_annotation is inspect.Signature.empty:
                missing.append("return")
            if missing:
                found.append(f"{qualified}: {', '.join(missing)}")
    return found


def test_public_functions_are_typed(package):
    untyped = [line for name in PUBLIC_MODULES[package.__name__] for line in _untyped(name)]
    assert not untyped, "add type hints to:\n" + "\n".join(untyped)


def test_ships_py_typed(package):
    assert (Path(package.__file__).parent / "py.typed").exists()


def test_benchmark_options_have_help(package):
    missing = []
    for path in sorted((REPO / FOLDER[package.__name__] / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                    and not any(k.arg == "help" for k in node.keywords)):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, "give these options help= text:\n" + "\n".join(missing)


@pytest.mark.parametrize("script", ["demo.py", "gnn_train.py", "llm_train.py", "report.py"])
def test_integration_script_options_have_help(script):
    path = REPO / "integration-tests" / script
    missing = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "add_argument" and not any(k.arg == "help" for k in node.keywords)]
    assert not missing, f"give the options of integration-tests/{script} at lines {missing} help= text"
