"""The CUDA code generator without a GPU: readable source (snapshot), every generated kernel of the three models
compiles with NVRTC for sm_80 and sm_90, compile errors quote the generated line, dumps."""

import os
from pathlib import Path

import pytest
import torch
from conftest import make_graph

import hector
import hector.nn as hn
from hector import config
from hector.codegen import CodegenOptions, compile_module, generate, layer_modules
from hector.passes import Options
from hector.runtime.graph import Graph

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
R = 3


def _graph():
    ei, et, nt = make_graph(node_types=2)
    return Graph(ei, et, 14, R, nt, 2)


def _nvrtc():
    if not hector._shared_cuda.ensure_nvrtc(hector._core):
        pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc)")


MODELS = {
    "rgcn": lambda: hn.RGCNConv(64, 64, R),
    "rgcn-bases": lambda: hn.RGCNConv(16, 24, R, num_bases=2, optimize="none"),
    "rgat": lambda: hn.RGATConv(64, 16, R, heads=4),
    "rgat-shared": lambda: hn.RGATConv(64, 16, R, heads=4, attention="shared", concat=False),
    "hgt": lambda: hn.HGTConv(64, 64, 2, R, heads=4),
    "hgt-typed-reorder": lambda: hn.HGTConv(32, 48, 2, R, heads=2, optimize="all"),
    # sums by source and pair without atomics (target-centric walks over sorted layouts)
    "rgcn-sorted": lambda: hn.RGCNConv(64, 64, R, optimize=Options(sorted_scatter=True)),
    "rgcn-uncompacted-sorted": lambda: hn.RGCNConv(64, 64, R, optimize=Options(compact=False, sorted_scatter=True)),
    "rgat-sorted": lambda: hn.RGATConv(64, 16, R, heads=4, optimize=Options(sorted_scatter=True)),
    "hgt-sorted": lambda: hn.HGTConv(64, 64, 2, R, heads=4, optimize=Options(sorted_scatter=True)),
}


def test_snapshot_rgat_forward():
    """The emitted source of a small RGAT forward, compared with the checked-in file (HECTOR_UPDATE_SNAPSHOTS=1
    rewrites it). Readable: IR names, one comment per IR op."""
    layer = hn.RGATConv(8, 4, R, heads=2, optimize="all")
    module = layer_modules(layer.train().compiled(_graph()))["forward"]
    path = SNAPSHOTS / "rgat_forward.cu"
    if os.environ.get("HECTOR_UPDATE_SNAPSHOTS"):
        path.write_text(module.source)
    assert module.source == path.read_text(), "generated source changed: review it, then HECTOR_UPDATE_SNAPSHOTS=1"
    # every op of the program appears as a comment in the kernel that evaluates it
    for node in layer.compiled(_graph()).forward.nodes:
        if node.op.kind.value not in ("leaf",):
            assert f"%{node.name} = " in module.source, node.name


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_every_kernel_compiles_with_nvrtc(dtype):
    """Forward (training and inference) and backward modules of every model, one NVRTC call per module."""
    _nvrtc()
    g = _graph()
    for name, make in MODELS.items():
        compiled = make().train().compiled(g)
        for tf32 in ((False, True) if dtype == "f32" else (False,)):
            for arch in (80, 90):
                mods = layer_modules(compiled, dtype, CodegenOptions(tf32=tf32, arch=arch))
                for kind, module in mods.items():
                    cubin = compile_module(module, arch)
                    assert cubin[:4] == b"\x7fELF", (name, kind, arch)


def test_compile_error_quotes_the_generated_line():
    _nvrtc()
    module = layer_modules(MODELS["rgat"]().train().compiled(_graph()))["forward"]
    head, kernels = module.source.split('extern "C"', 1)
    broken = head + 'extern "C"' + kernels.replace("hexp(", "hexp_missing(", 1)
    with pytest.raises(hector.CompileError) as err:
        compile_module(type(module)(module.name, broken, module.kernels, module.dtypes), 90)
    assert "hexp_missing" in str(err.value) and "failing source lines" in str(err.value)


def test_unknown_dtype_is_refused():
    compiled = MODELS["rgcn"]().train().compiled(_graph())
    with pytest.raises(ValueError, match="unsupported dtype"):
        generate(compiled.forward_lowered, {}, "int8")


def test_dump_api_and_env(tmp_path, monkeypatch, env_settings):
    mods = layer_modules(MODELS["hgt"]().train().compiled(_graph()))
    assert set(mods) == {"forward", "inference", "backward"}
    for module in mods.values():
        assert module.source.count('extern "C" __global__') == sum(1 for k in module.kernels if not k.torch_op)
    config.set_dump_dir(tmp_path)
    try:
        assert config.dump_dir() == str(tmp_path)
    finally:
        config.set_dump_dir(None)
    monkeypatch.setenv("HECTOR_DUMP_DIR", str(tmp_path / "env"))
    env_settings()
    assert config.dump_dir() == str(tmp_path / "env")


def test_backend_setting_validated(monkeypatch, env_settings):
    monkeypatch.setenv("HECTOR_BACKEND", "gpu")
    with pytest.raises(ValueError, match="HECTOR_BACKEND.*reference"):
        env_settings()
    with pytest.raises(ValueError):
        config.set_backend("gpu")
    monkeypatch.setenv("HECTOR_BACKEND", "reference")
    env_settings()
    assert config.backend() == "reference"
    _ = torch


@pytest.mark.parametrize("arch", [80, 90])
def test_tile_schedule_kernel_compiles_with_nvrtc(arch):
    """The backend's fixed tile-schedule kernel (hector.codegen.schedule) compiles like the generated modules."""
    from hector.codegen import compile_module, schedule

    _nvrtc()
    assert compile_module(schedule.MODULE, arch)


@pytest.mark.parametrize("arch", [80, 90])
def test_zero_fill_kernel_compiles_with_nvrtc(arch):
    """The backend's fixed zero-fill kernel (hector.codegen.fill) compiles like the generated modules."""
    from hector.codegen import compile_module, fill

    _nvrtc()
    assert compile_module(fill.MODULE, arch)
