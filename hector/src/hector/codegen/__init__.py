"""Code generation: CUDA C++ source from lowered kernel specifications (see :mod:`hector.codegen.cuda`).

``layer_modules(layer.compiled(graph))`` returns the generated modules of a layer (forward, inference, backward);
``module.source`` is the CUDA text. ``HECTOR_DUMP_DIR`` also writes every module the CUDA backend compiles.
"""

from .cuda import CodegenOptions, KernelCode, ModuleCode, compile_module, generate, layer_modules

__all__ = ["CodegenOptions", "KernelCode", "ModuleCode", "compile_module", "generate", "layer_modules"]
