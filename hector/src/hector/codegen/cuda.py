"""CUDA C++ emitters: a lowered program (:mod:`hector.lower`) becomes one CUDA module with one kernel per spec.

Every kernel is ``extern "C"``, named after its spec (``k4_traversal``), reads and writes the values the spec names
(pointer parameters ``p_<ir name>``) and carries a comment with the IR line of every op it evaluates. Nothing here
needs torch or a GPU: :func:`generate` returns the source text and, per kernel, the parameter list with what the
runtime binds to each parameter, the launch shape, and the outputs it allocates.

Kernel families (the lowering's, see :mod:`hector.lower.kernels`):

* **traversal** over edges: one *group* of ``G`` threads per destination node (heaviest destinations first), walking
  the destination's in-edges (edges are kept sorted by destination, so they are one contiguous range). Element ``j``
  of a per-row value lives in lane ``j % G``, register slot ``j / G``. Edge softmax and sums into the destination
  are register reductions over the walk; a value needed after such a reduction is recomputed in a later walk over
  the same edges (no per-edge temporary is written unless the plan materialises it). Reductions by another key
  (source, unique pair, type) are atomics; sums into small params are pre-reduced in shared memory per block.
  A destination with more in-edges than ``CodegenOptions.split_degree`` is walked by every group of a block at
  once, their partial sums and softmax statistics combined in shared memory (a hub no longer bounds the kernel).
* **traversal** over nodes / unique pairs: one group per row.
* **gemm** ``linear``: a segment GEMM over a device-side tile schedule (tiles never cross a type boundary, so a tile
  has one weight), A rows read through the gather index, an optional row-scale and an atomic scatter epilogue.
* **gemm** ``outer_sum`` (weight gradient): per tile ``C[type] += A^T B`` in registers, flushed with atomics.
* **param**: weight-only einsums, one thread per output element (long reductions: ``torch.einsum`` in the runtime).

One module per family (``traversal``, ``gemm``, ``outer_sum``, ``param``) on the shared pieces of ``common`` and
the expression templates of ``templates``; this module picks the family of each kernel spec and assembles the
module (prelude, kernels, emulator entry points).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ir.core import Op, Program
from ..lower.kernels import Lowered
from .common import (
    _LEAVES,
    BLOCK,
    CTYPE,
    DTYPES,
    Arg,
    CodegenOptions,
    KernelCode,
    Launch,
    ModuleCode,
    Output,
    _Emitter,
    _Gen,
    acc_dtype,
    cname,
)
from .gemm import _Gemm
from .outer_sum import _OuterSum
from .param import _ParamKernel
from .prelude import PRELUDE, WMMA, WMMA_CUDA, WMMA_EMULATED
from .traversal import _Traversal

DEFAULT_OPTIONS = CodegenOptions()

# The emitter of each kernel family, by the lowering's kernel kind (GEMM kernels by their op).
FAMILIES: dict[str, type[_Emitter]] = {"traversal": _Traversal, "param": _ParamKernel, "linear": _Gemm,
                                        "outer_sum": _OuterSum}


def generate(lowered: Lowered, dtypes: Mapping[str, str], model_dtype: str,
             options: CodegenOptions = DEFAULT_OPTIONS) -> ModuleCode:
    """CUDA source for every kernel of ``lowered``. ``dtypes`` gives the storage type ("f32", "f64", "bf16",
    "f16") of every leaf the program reads; values the kernels write get ``model_dtype``, or its accumulation type
    where they are summed with atomics (scatters, weight gradients)."""
    if model_dtype not in CTYPE:
        raise ValueError(f"unsupported dtype {model_dtype!r}; the CUDA backend supports {list(CTYPE)}")
    gen = _Gen(lowered, dtypes, model_dtype, options)
    p = lowered.program
    for n in p.nodes:
        if n.op in _LEAVES and n.op is not Op.DROPOUT_MASK and n.name not in gen.dtypes:
            raise ValueError(f"no dtype given for leaf {n.name}")
    pieces, kernels = [], []
    for spec in lowered.kernels:
        if spec.kind == "rng":
            (name,) = spec.outputs or spec.nodes
            gen.dtypes[name] = model_dtype
            kernels.append(KernelCode(spec.name, spec, (), Launch("torch", 0), (Output(name, model_dtype, False),),
                                      torch_op="rng"))
            continue
        family = dict(spec.detail)["op"] if spec.kind == "gemm" else spec.kind
        emitter: _Emitter = FAMILIES[family](gen, spec)
        text, code = emitter.generate()
        if text:
            pieces.append(text)
        kernels.append(code)
    used = {a.bind[1] for k in kernels for a in k.args if a.bind[0] in ("value", "out")}
    header = [f"// hector: generated CUDA for program {p.name} ({len(kernels)} kernels, storage {model_dtype}, "
              f"accumulation {gen.acc})",
              f"typedef {CTYPE[gen.acc]} acc_t;",
              PRELUDE]
    assert len(gen.tc_kinds) <= 1
    for tc in gen.tc_kinds:
        header += [WMMA, WMMA_CUDA[tc], f"#define HW_ELEM {'float' if tc == 'tf32' else CTYPE[tc]}",
                   f"#define HW_KSTEP {8 if tc == 'tf32' else 16}", WMMA_EMULATED]
    stubs = ["#ifdef HECTOR_EMULATE  // entry points for the CPU emulator used by the tests"]
    for k in kernels:
        if k.torch_op:
            continue
        unpack = ", ".join(f"*({a.ctype.replace('__restrict__', '').strip()}*)a[{i}]"
                           for i, a in enumerate(k.args))
        stubs.append(f'extern "C" void hector_emu_{k.name}(void** a) {{ {k.name}({unpack}); }}')
    stubs.append("#endif")
    source = "\n".join(header + pieces + stubs) + "\n"
    return ModuleCode(p.name, source, tuple(kernels),
                      tuple(sorted((n, d) for n, d in gen.dtypes.items() if n in used)))


def leaf_dtypes(program: Program, model_dtype: str, saved: Mapping[str, str] | None = None) -> dict[str, str]:
    """Storage dtypes of a program's leaves as the CUDA backend binds them: inputs and params in the model dtype,
    graph constants in the accumulation dtype, saved forward values as the forward module stored them."""
    out = {}
    for n in program.nodes:
        if n.op in (Op.INPUT, Op.PARAM):
            out[n.name] = model_dtype
        elif n.op is Op.GRAPH:
            out[n.name] = acc_dtype(model_dtype)
        elif n.op is Op.SAVED:
            out[n.name] = (saved or {}).get(n.attr("name"), model_dtype)
    return out


def layer_modules(compiled: Any, model_dtype: str = "f32",
                  options: CodegenOptions = DEFAULT_OPTIONS) -> dict[str, ModuleCode]:
    """The CUDA modules of a compiled layer (:class:`hector.runtime.compiled.CompiledLayer`): ``forward``
    (training: keeps what the backward reads), ``inference`` and ``backward`` (all gradients)."""
    fwd = generate(compiled.forward_lowered, leaf_dtypes(compiled.forward, model_dtype), model_dtype, options)
    inf = generate(compiled.inference_lowered, leaf_dtypes(compiled.forward, model_dtype), model_dtype, options)
    bw = compiled.full_backward.program
    stored = dict(fwd.dtypes)
    saved = {name: stored.get(name, model_dtype) for name in compiled.saved}
    back = generate(compiled.full_backward_lowered, leaf_dtypes(bw, model_dtype, saved), model_dtype, options)
    return {"forward": fwd, "inference": inf, "backward": back}


def compile_module(module: ModuleCode, arch: int) -> bytes:
    """Compile a module with NVRTC for ``sm_<arch>`` (no GPU needed); raises ``hector.CompileError`` quoting the
    failing generated lines. Cached on disk like every JIT compile."""
    from .. import _core, _shared_cuda

    return _shared_cuda.compile_kernel_source(_core, module.source, f"{module.name}.cu", arch=arch)


__all__ = ["BLOCK", "CTYPE", "DTYPES", "Arg", "CodegenOptions", "KernelCode", "Launch", "ModuleCode", "Output",
           "acc_dtype", "cname", "compile_module", "generate", "layer_modules", "leaf_dtypes"]
