"""Custom operators: when no existing op is fast enough, write one (lab 09 custom ops).

The example is the LLTM cell, a small recurrent cell, in four forms that all compute the same:

- ``lltm``: ``lltm_ref`` (autograd PyTorch, the reference), the hand-written Python ops
  (``PYTHON_OPS``), ``LLTMFunction`` over any ops backend, and the ``LLTM`` module;
- ``sources``: the C++ source (``reference_cpp_source``, the graded exercise) and the CUDA source
  with fused gate kernels; ``build_cpp``, ``build_cuda``, ``compile_cuda`` (nvcc without a GPU)
  and ``first_compiler_error``;
- ``pch``: what every ``build_cpp`` reuses (``pch.ensure`` makes it once per machine): the tensor
  header precompiled and the bindings compiled, so a build compiles the source alone;
- ``library``: the cell registered as ``torch.ops.fastdl.lltm_forward`` / ``lltm_backward`` with
  fake implementations and autograd, so ``torch.compile`` traces it without a graph break;
- ``bench``: the benchmark spec, ``benchmark`` and ``check``.

Importing the package builds nothing and imports no compiler tooling; it registers the two ops.
"""

from fastdl_lab.custom.lltm import (BACKENDS, LLTM, PYTHON_OPS, LLTMFunction, LLTMOps, lltm_backward, lltm_cell,
                                    lltm_forward, lltm_ref, ops_of)
from fastdl_lab.custom.sources import (CUDA_DECLARATIONS, CUDA_SOURCE, FUNCTIONS, build_cpp, build_cuda,
                                       compile_cuda, default_build_root, find_nvcc, first_compiler_error,
                                       nvcc_command, nvcc_version, reference_cpp_source)
from fastdl_lab.custom.library import current_ops, lltm_op, use_ops, using_ops
from fastdl_lab.custom.bench import BENCHMARK, benchmark, check

__all__ = ["BACKENDS", "LLTM", "PYTHON_OPS", "LLTMFunction", "LLTMOps", "lltm_backward", "lltm_cell", "lltm_forward",
           "lltm_ref", "ops_of", "CUDA_DECLARATIONS", "CUDA_SOURCE", "FUNCTIONS", "build_cpp", "build_cuda",
           "compile_cuda", "default_build_root", "find_nvcc", "first_compiler_error", "nvcc_command",
           "nvcc_version", "reference_cpp_source", "current_ops", "lltm_op", "use_ops", "using_ops", "BENCHMARK",
           "benchmark", "check"]
