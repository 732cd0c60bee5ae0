"""The LLTM cell in C++ and CUDA C++, and the helpers that build them (lab 09 custom ops).

- ``reference_cpp_source()``: forward and backward with the ATen C++ API (the graded exercise:
  the student writes this source; everything else here serves any source);
- ``build_cpp``: the source against torch's tensor API, linked to pybind11 bindings of
  ``lltm_forward`` and ``lltm_backward`` compiled once per machine (``pch``), into a chosen folder;
  ``build_library`` makes the same build without loading it (the shared object, the source's
  object file and the unit as compiled come back as files, for a grader to judge) and
  ``load_library`` loads such a shared object from wherever it lies; ``first_compiler_error`` turns
  a failed build into one readable line;
- ``CUDA_SOURCE``: the two matrix products stay with ATen (cuBLAS), and one fused kernel per pass
  does all the elementwise gate math, where the C++ version launches one kernel per operator and
  sends every intermediate through memory;
- ``compile_cuda``: ``nvcc`` compiles ``CUDA_SOURCE`` for sm_80 or sm_90 with no GPU present:
  proof that the source is valid CUDA for both course GPUs. Compile only: linking needs the CUDA
  build of torch, and the CPU build here has no CUDA libraries;
- ``build_cuda``: the extension itself, on a GPU host only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from fastdl_lab.custom import pch

FUNCTIONS = ["lltm_forward", "lltm_backward"]
# torch's load adds no optimisation flag of its own; -O2 is what a setup.py build would use, and
# the timing table compares optimised builds. It costs a few seconds of the half-minute build.
OPTIMISE = ["-O2"]
REPO = Path(__file__).resolve().parents[2]


def reference_cpp_source() -> str:
    """The C++ source of ``lltm_forward`` and ``lltm_backward`` (see ``lltm.py`` for the contract)."""
    ### BEGIN SOLUTION
    return r"""
#include <torch/extension.h>

#include <vector>

// The forward hands back every activation the backward reads, so the backward recomputes nothing
// but tanh(new_cell).
std::vector<torch::Tensor> lltm_forward(torch::Tensor input, torch::Tensor weights, torch::Tensor bias,
                                        torch::Tensor old_h, torch::Tensor old_cell) {
  auto X = torch::cat({old_h, input}, /*dim=*/1);
  auto gate_weights = torch::addmm(bias, X, weights.t());
  auto gates = gate_weights.chunk(3, /*dim=*/1);
  auto input_gate = torch::sigmoid(gates[0]);
  auto output_gate = torch::sigmoid(gates[1]);
  auto candidate_cell = torch::elu(gates[2], /*alpha=*/1.0);
  auto new_cell = old_cell + candidate_cell * input_gate;
  auto new_h = torch::tanh(new_cell) * output_gate;
  return {new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights};
}

std::vector<torch::Tensor> lltm_backward(torch::Tensor grad_h, torch::Tensor grad_cell, torch::Tensor new_cell,
                                         torch::Tensor input_gate, torch::Tensor output_gate,
                                         torch::Tensor candidate_cell, torch::Tensor X, torch::Tensor gate_weights,
                                         torch::Tensor weights) {
  auto tanh_cell = torch::tanh(new_cell);
  // new_cell reaches the loss twice: as itself, and through new_h = tanh(new_cell) * output_gate.
  auto d_new_cell = grad_cell + grad_h * output_gate * (1 - tanh_cell * tanh_cell);
  // sigmoid' = s (1 - s), from the saved gates.
  auto d_input_pre = d_new_cell * candidate_cell * input_gate * (1 - input_gate);
  auto d_output_pre = grad_h * tanh_cell * output_gate * (1 - output_gate);
  // ELU's slope is 1 above zero and exp(z) = ELU(z) + 1 below.
  auto pre_candidate = gate_weights.chunk(3, /*dim=*/1)[2];
  auto d_elu = torch::where(pre_candidate > 0, torch::ones_like(candidate_cell), candidate_cell + 1);
  auto d_candidate_pre = d_new_cell * input_gate * d_elu;
  auto d_gates = torch::cat({d_input_pre, d_output_pre, d_candidate_pre}, /*dim=*/1);

  auto d_weights = d_gates.t().mm(X);
  auto d_bias = d_gates.sum(/*dim=*/0);
  // Two products, not two slices of one: results that share storage are not allowed to a
  // torch.library op.
  const auto state_size = grad_h.size(1);
  auto d_old_h = d_gates.mm(weights.narrow(1, 0, state_size));
  auto d_input = d_gates.mm(weights.narrow(1, state_size, weights.size(1) - state_size));
  return {d_old_h, d_input, d_weights, d_bias, d_new_cell};
}
"""
    ### END SOLUTION


# The CUDA source includes only the per-operator ATen headers it uses, not torch/extension.h:
# the nvcc pass then parses a fraction of ATen (and no Python headers), so compile_cuda is cheap.
CUDA_SOURCE = r"""
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; a grid-stride loop covers larger tensors.
constexpr int64_t kMaxBlocks = 1 << 16;

template <typename scalar_t>
__device__ __forceinline__ scalar_t sigmoid(scalar_t z) {
  return scalar_t(1) / (scalar_t(1) + exp(-z));
}

// One thread per (row, column) of the state: it reads the three gate pre-activations of that
// column from the (B, 3S) product and writes all five outputs, one trip through memory in all.
template <typename scalar_t>
__global__ void lltm_forward_kernel(const scalar_t* __restrict__ gates, const scalar_t* __restrict__ old_cell,
                                    scalar_t* __restrict__ new_h, scalar_t* __restrict__ new_cell,
                                    scalar_t* __restrict__ input_gate, scalar_t* __restrict__ output_gate,
                                    scalar_t* __restrict__ candidate_cell, int64_t batch, int64_t state) {
  const int64_t n = batch * state;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t row = i / state;
    const scalar_t* g = gates + row * 3 * state + (i - row * state);
    const scalar_t in = sigmoid(g[0]);
    const scalar_t out = sigmoid(g[state]);
    const scalar_t z = g[2 * state];
    // expm1 keeps ELU's small negative values accurate, as ATen's elu does.
    const scalar_t candidate = z > scalar_t(0) ? z : expm1(z);
    const scalar_t cell = old_cell[i] + candidate * in;
    input_gate[i] = in;
    output_gate[i] = out;
    candidate_cell[i] = candidate;
    new_cell[i] = cell;
    new_h[i] = tanh(cell) * out;
  }
}

// The whole elementwise chain rule in one pass: gradients of the three pre-activations into the
// (B, 3S) d_gates, and the gradient of old_cell.
template <typename scalar_t>
__global__ void lltm_backward_kernel(const scalar_t* __restrict__ grad_h, const scalar_t* __restrict__ grad_cell,
                                     const scalar_t* __restrict__ new_cell, const scalar_t* __restrict__ input_gate,
                                     const scalar_t* __restrict__ output_gate,
                                     const scalar_t* __restrict__ candidate_cell, const scalar_t* __restrict__ gates,
                                     scalar_t* __restrict__ d_gates, scalar_t* __restrict__ d_old_cell, int64_t batch,
                                     int64_t state) {
  const int64_t n = batch * state;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t row = i / state;
    const int64_t g = row * 3 * state + (i - row * state);
    const scalar_t one = scalar_t(1);
    const scalar_t t = tanh(new_cell[i]);
    const scalar_t in = input_gate[i], out = output_gate[i], candidate = candidate_cell[i];
    const scalar_t d_cell = grad_cell[i] + grad_h[i] * out * (one - t * t);
    const scalar_t d_elu = gates[g + 2 * state] > scalar_t(0) ? one : candidate + one;
    d_gates[g] = d_cell * candidate * in * (one - in);
    d_gates[g + state] = grad_h[i] * t * out * (one - out);
    d_gates[g + 2 * state] = d_cell * in * d_elu;
    d_old_cell[i] = d_cell;
  }
}

int blocks_for(int64_t n) {
  return int(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

void check_inputs(std::initializer_list<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK(t.is_cuda(), "lltm (CUDA): every tensor must be on a CUDA device");
    TORCH_CHECK(t.device() == tensors.begin()->device(), "lltm (CUDA): tensors on different devices");
    TORCH_CHECK(t.scalar_type() == tensors.begin()->scalar_type(), "lltm (CUDA): tensors of different dtypes");
  }
}

}  // namespace

std::vector<at::Tensor> lltm_forward(at::Tensor input, at::Tensor weights, at::Tensor bias, at::Tensor old_h,
                                     at::Tensor old_cell) {
  check_inputs({input, weights, bias, old_h, old_cell});
  const c10::cuda::CUDAGuard guard(input.device());
  auto X = at::cat({old_h, input}, /*dim=*/1);
  auto gate_weights = at::addmm(bias, X, weights.t()).contiguous();
  old_cell = old_cell.contiguous();
  const int64_t batch = old_cell.size(0), state = old_cell.size(1);
  auto new_h = at::empty_like(old_cell);
  auto new_cell = at::empty_like(old_cell);
  auto input_gate = at::empty_like(old_cell);
  auto output_gate = at::empty_like(old_cell);
  auto candidate_cell = at::empty_like(old_cell);
  if (batch * state > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(gate_weights.scalar_type(), "lltm_forward_cuda", [&] {
      lltm_forward_kernel<scalar_t><<<blocks_for(batch * state), kThreads, 0, stream>>>(
          gate_weights.const_data_ptr<scalar_t>(), old_cell.const_data_ptr<scalar_t>(),
          new_h.mutable_data_ptr<scalar_t>(), new_cell.mutable_data_ptr<scalar_t>(),
          input_gate.mutable_data_ptr<scalar_t>(), output_gate.mutable_data_ptr<scalar_t>(),
          candidate_cell.mutable_data_ptr<scalar_t>(), batch, state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights};
}

std::vector<at::Tensor> lltm_backward(at::Tensor grad_h, at::Tensor grad_cell, at::Tensor new_cell,
                                      at::Tensor input_gate, at::Tensor output_gate, at::Tensor candidate_cell,
                                      at::Tensor X, at::Tensor gate_weights, at::Tensor weights) {
  check_inputs({grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights});
  const c10::cuda::CUDAGuard guard(grad_h.device());
  // Gradients of a sum arrive expanded (stride 0); the kernel indexes dense rows.
  grad_h = grad_h.contiguous();
  grad_cell = grad_cell.contiguous();
  new_cell = new_cell.contiguous();
  input_gate = input_gate.contiguous();
  output_gate = output_gate.contiguous();
  candidate_cell = candidate_cell.contiguous();
  gate_weights = gate_weights.contiguous();
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  auto d_gates = at::empty_like(gate_weights);
  auto d_old_cell = at::empty_like(new_cell);
  if (batch * state > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(gate_weights.scalar_type(), "lltm_backward_cuda", [&] {
      lltm_backward_kernel<scalar_t><<<blocks_for(batch * state), kThreads, 0, stream>>>(
          grad_h.const_data_ptr<scalar_t>(), grad_cell.const_data_ptr<scalar_t>(),
          new_cell.const_data_ptr<scalar_t>(), input_gate.const_data_ptr<scalar_t>(),
          output_gate.const_data_ptr<scalar_t>(), candidate_cell.const_data_ptr<scalar_t>(),
          gate_weights.const_data_ptr<scalar_t>(), d_gates.mutable_data_ptr<scalar_t>(),
          d_old_cell.mutable_data_ptr<scalar_t>(), batch, state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  auto d_weights = d_gates.t().mm(X);
  auto d_bias = d_gates.sum(/*dim=*/0);
  auto d_old_h = d_gates.mm(weights.narrow(1, 0, state));
  auto d_input = d_gates.mm(weights.narrow(1, state, weights.size(1) - state));
  return {d_old_h, d_input, d_weights, d_bias, d_old_cell};
}
"""

# The C++ side of the CUDA extension: declarations for the generated bindings.
CUDA_DECLARATIONS = r"""
#include <torch/extension.h>

#include <vector>

std::vector<at::Tensor> lltm_forward(at::Tensor input, at::Tensor weights, at::Tensor bias, at::Tensor old_h,
                                     at::Tensor old_cell);
std::vector<at::Tensor> lltm_backward(at::Tensor grad_h, at::Tensor grad_cell, at::Tensor new_cell,
                                      at::Tensor input_gate, at::Tensor output_gate, at::Tensor candidate_cell,
                                      at::Tensor X, at::Tensor gate_weights, at::Tensor weights);
"""

# The Python side of every C++ build, compiled once per machine (pch.ensure): what load_inline
# would generate for FUNCTIONS, bound to the course's fixed signatures. GLUE, compiled with each
# source, calls the source's functions from those signatures, whatever parameter types it chose.
BINDINGS_SOURCE = r"""
#include <torch/python.h>
#include <torch/types.h>

#include <vector>

#define FASTDL_HIDDEN __attribute__((visibility("hidden")))

FASTDL_HIDDEN std::vector<at::Tensor> fastdl_lltm_forward(at::Tensor input, at::Tensor weights, at::Tensor bias,
                                                          at::Tensor old_h, at::Tensor old_cell);
FASTDL_HIDDEN std::vector<at::Tensor> fastdl_lltm_backward(at::Tensor grad_h, at::Tensor grad_cell,
                                                           at::Tensor new_cell, at::Tensor input_gate,
                                                           at::Tensor output_gate, at::Tensor candidate_cell,
                                                           at::Tensor X, at::Tensor gate_weights, at::Tensor weights);

PYBIND11_MODULE(fastdl_lltm_bindings, m) {
  m.def("lltm_forward", torch::wrap_pybind_function(fastdl_lltm_forward), "lltm_forward");
  m.def("lltm_backward", torch::wrap_pybind_function(fastdl_lltm_backward), "lltm_backward");
}
"""

# After the source: the functions the bindings call, which call the source's whatever parameter
# types it chose, and the module's entry point, which hands over to the bindings' own (with
# pybind11's multi-phase initialisation the module takes the name it is imported under).
_ADAPTERS = r"""

__attribute__((visibility("hidden"))) std::vector<at::Tensor> fastdl_lltm_forward(
    at::Tensor input, at::Tensor weights, at::Tensor bias, at::Tensor old_h, at::Tensor old_cell) {
  return lltm_forward(input, weights, bias, old_h, old_cell);
}

__attribute__((visibility("hidden"))) std::vector<at::Tensor> fastdl_lltm_backward(
    at::Tensor grad_h, at::Tensor grad_cell, at::Tensor new_cell, at::Tensor input_gate, at::Tensor output_gate,
    at::Tensor candidate_cell, at::Tensor X, at::Tensor gate_weights, at::Tensor weights) {
  return lltm_backward(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights);
}

struct _object;
extern "C" _object* PyInit_fastdl_lltm_bindings();
"""
# torch's load names the entry after the build (TORCH_EXTENSION_NAME), which it versions when a
# source changes within one process.
_VERSIONED_ENTRY = r"""#define FASTDL_ENTRY_(name) PyInit_##name
#define FASTDL_ENTRY(name) FASTDL_ENTRY_(name)
extern "C" __attribute__((visibility("default"))) _object* FASTDL_ENTRY(TORCH_EXTENSION_NAME)() {
  return PyInit_fastdl_lltm_bindings();
}
"""
_NAMED_ENTRY = r"""extern "C" __attribute__((visibility("default"))) _object* PyInit_{name}() {{
  return PyInit_fastdl_lltm_bindings();
}}
"""
GLUE = _ADAPTERS + _VERSIONED_ENTRY


def glue(name: str) -> str:
    """What follows the source in a build named ``name`` (``build_library``): no macro is used or
    defined in it, so after preprocessing it reads exactly as written, unless the source before it
    redefined one of its words."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"an extension's name is a C identifier, not {name!r}")
    return _ADAPTERS + _NAMED_ENTRY.format(name=name)


# ---------------------------------------------------------------------------------------------
# Building


def default_build_root() -> Path:
    """Where builds go unless told: $TORCH_EXTENSIONS_DIR, else the project's build cache."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or REPO / "build" / "cache" / "torch_extensions")


def _build_folder(name: str, build_dir: Path | None) -> Path:
    folder = Path(build_dir) if build_dir is not None else default_build_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def build_cpp(source: str | None = None, *, name: str, build_dir: Path | None = None, verbose: bool = False):
    """Compile a C++ source defining ``lltm_forward`` / ``lltm_backward`` into an importable module.

    ``source=None`` builds the reference (``reference_cpp_source()``, the graded region: in the
    student copy of the package that raises NotImplementedError, so graders always pass the
    source they grade). ``build_dir`` is this build's own folder (created; default
    ``default_build_root() / name``); an unchanged source in the same folder is not rebuilt.

    As ``load_inline`` does, the build puts ``#include <torch/extension.h>`` before the source, so
    the compiler's line numbers are one more than the source's, and gives Python the two
    functions. What that header holds here is torch's tensor API (``pch``): ATen, the ``torch::``
    tensor names and c10, which is all a source of the course may use. The functions must take
    the course's tensors (by value or by reference) and return ``std::vector<torch::Tensor>``. A
    failed build raises torch's own error; ``first_compiler_error(str(error))`` gives its first
    line worth reading.
    """
    from torch.utils.cpp_extension import load

    if source is None:
        source = reference_cpp_source()
    folder = _build_folder(name, build_dir)
    main = _write_if_changed(folder / "main.cpp", f"#include <{pch.HEADER}>\n{source}\n{GLUE}")
    return load(name=name, build_directory=str(folder), verbose=verbose, **_build_arguments(folder, main))


def _build_arguments(folder: Path, main: Path) -> dict:
    """What torch's build is given besides the name and the folder: the units, the flags and the
    precompiled parts (``pch``) where they are ready."""
    # Made once per machine where ready: without it the build makes both parts itself, slower
    # (the bindings alone take half a minute), never different.
    ready = pch.usable(OPTIMISE)
    if ready:
        headers, units, objects = ready, [], [str(ready / pch.BINDINGS)]
    else:
        headers = folder / "headers"
        _write_if_changed(headers / pch.HEADER, pch.TENSOR_HEADER)
        units, objects = [_write_if_changed(folder / "bindings.cpp", BINDINGS_SOURCE)], []
    return {"sources": [str(main), *map(str, units)], "extra_cflags": OPTIMISE + (["-Winvalid-pch"] if ready else []),
            "extra_include_paths": [str(headers)], "extra_ldflags": objects}


# The first line of a build_library unit after the tensor header: what the compiler saw of the
# source starts after it (``BuiltLibrary.preprocessed``), whatever the header expanded to.
SOURCE_BEGINS = "namespace fastdl_source_begins {}"


class BuiltLibrary(NamedTuple):
    """The files of one ``build_library``: the shared object, the object file of the source's unit
    (the source and ``glue(name)``), and that unit as the compiler saw it after preprocessing."""
    shared_object: Path
    unit: Path
    preprocessed: Path


def build_library(source: str, *, name: str, build_dir: Path) -> BuiltLibrary:
    """Compile ``source`` as ``build_cpp`` does, into ``build_dir``, and load nothing: the files
    come back for someone else to judge and load (``load_library``), so no code of the source
    runs here. The unit is ``#include <torch/extension.h>``, ``SOURCE_BEGINS``, the source (its
    line numbers one more than its own, as in ``build_cpp``) and ``glue(name)``; g++ keeps the
    preprocessed unit it compiles (``-save-temps``), which is the unit exactly as compiled. A
    failed build raises torch's own error, as ``build_cpp``'s does."""
    import inspect

    from torch.utils import cpp_extension

    folder = _build_folder(name, build_dir)
    main = _write_if_changed(folder / "main.cpp",
                             f"#include <{pch.HEADER}>\n{SOURCE_BEGINS}\n#line 2\n{source}\n{glue(name)}")
    arguments = _build_arguments(folder, main)
    arguments["extra_cflags"] = [*arguments["extra_cflags"], "-save-temps=obj"]
    # torch's load is this build followed by an import; torch offers the build alone only under a
    # private name, so its parameters are matched by name.
    build = getattr(cpp_extension, "_write_ninja_file_and_build_library", None)
    if build is None:
        raise RuntimeError("this version of torch has no build without a load (_write_ninja_file_and_build_library)")
    wanted = {"name": name, "extra_cuda_cflags": [], "extra_sycl_cflags": [], "build_directory": str(folder),
              "verbose": False, "with_cuda": False, "with_sycl": False, "is_standalone": False, **arguments}
    accepted = inspect.signature(build).parameters
    build(**{key: value for key, value in wanted.items() if key in accepted})
    built = BuiltLibrary(folder / f"{name}.so", folder / "main.o", folder / "main.ii")
    missing = [path.name for path in built if not path.is_file()]
    if missing:
        raise RuntimeError(f"the build left no {', '.join(missing)}")
    return built


def load_library(path: str | Path, name: str):
    """Import the extension a ``build_library`` named ``name`` made, from wherever its shared object
    now lies (torch must be imported first: the object leaves its symbols to torch's libraries)."""
    import importlib.util

    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_if_changed(path: Path, text: str) -> Path:
    """An unchanged file keeps its time, so ninja does not compile it again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def build_cuda(source: str | None = None, *, name: str, build_dir: Path | None = None, verbose: bool = False):
    """Build the CUDA extension (``CUDA_SOURCE`` unless given); needs a CUDA device and torch."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA extension needs a GPU host (torch.cuda.is_available() is False)")
    from torch.utils.cpp_extension import load_inline

    # Our sources carry their own includes: without the implicit torch/types.h the .cu parses
    # only the ATen headers it names, as compile_cuda compiles it.
    return load_inline(name=name, cpp_sources=[CUDA_DECLARATIONS], cuda_sources=[source or CUDA_SOURCE],
                       functions=FUNCTIONS, extra_cflags=OPTIMISE, extra_cuda_cflags=OPTIMISE,
                       build_directory=str(_build_folder(name, build_dir)), verbose=verbose,
                       no_implicit_headers=True)


# ---------------------------------------------------------------------------------------------
# Compiler output

# g++ and nvcc's front end say "error:" (gcc "fatal error:" too); ptxas says "error   :".
_ERROR = re.compile(r"\berror\s*:")
_LOADER = re.compile(r"undefined (symbol|reference)")
_PATH = re.compile(r"(?:[^\s:'\"()]*/)+(?=[^/\s:'\"()]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MAX_REASON = 400


def first_compiler_error(text: str) -> str:
    """The first compiler error line in a failed build's output, without folder names.

    Falls back to the first "undefined symbol" / "undefined reference" line (a function declared
    but never defined), then to the text's first non-empty line.
    """
    lines = [_ANSI.sub("", line).strip() for line in str(text).splitlines()]
    lines = [line for line in lines if line]
    # collect2's "error: ld returned 1 exit status" says less than the linker's own line.
    compiler = [line for line in lines if _ERROR.search(line) and not line.startswith("collect2")]
    loader = [line for line in lines if _LOADER.search(line)]
    chosen = (compiler or loader or lines or ["(no output)"])[0]
    # Folder names differ per build (a private temporary folder); the file name is what helps.
    chosen = _PATH.sub("", chosen)
    return chosen if len(chosen) <= _MAX_REASON else chosen[: _MAX_REASON - 3] + "..."


# ---------------------------------------------------------------------------------------------
# nvcc without a GPU

# The CPU wheel of torch ships the c10/cuda headers but not this one, which CMake generates for
# CUDA builds; the stand-in holds the same single definition the CUDA wheel's does.
_GENERATED_HEADERS = {"c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"}


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME or /usr/local/cuda; None if there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def nvcc_command(capability: int, src: Path, out: Path, *, ptx: bool, include: list[str]) -> list[str]:
    """The nvcc command line compile_cuda runs (torch's own CUDA flags, C++20 as torch needs)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("no nvcc on PATH, under $CUDA_HOME or in /usr/local/cuda/bin")
    return [nvcc, f"-arch=sm_{capability}", "--ptx" if ptx else "-c", "-std=c++20", *OPTIMISE,
            *COMMON_NVCC_FLAGS, *(f"-I{path}" for path in include), "-o", str(out), str(src)]


def compile_cuda(capability: int, source: str | None = None, *, ptx: bool = True) -> bytes:
    """Compile a CUDA source (default ``CUDA_SOURCE``) for sm_<capability> with nvcc; no GPU needed.

    ``ptx=True`` returns the PTX text (as bytes), ``ptx=False`` the object file of ``-c`` (host
    code and the sm_<capability> cubin). Compile only: nothing is linked or loaded. A failed
    compile raises RuntimeError whose message starts with ``first_compiler_error`` of the output.
    """
    from torch.utils.cpp_extension import include_paths

    with tempfile.TemporaryDirectory(prefix="fastdl-nvcc-") as tmp:
        tmp = Path(tmp)
        for relative, text in _GENERATED_HEADERS.items():
            (tmp / "include" / relative).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "include" / relative).write_text(text)
        src, out = tmp / "lltm.cu", tmp / ("lltm.ptx" if ptx else "lltm.o")
        src.write_text(source or CUDA_SOURCE)
        cmd = nvcc_command(capability, src, out, ptx=ptx, include=[*include_paths(), str(tmp / "include")])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            output = done.stdout + done.stderr
            raise RuntimeError(f"{first_compiler_error(output)}\n(nvcc sm_{capability} failed)\n{output}")
        return out.read_bytes()


def nvcc_version() -> str | None:
    """The release line of ``nvcc --version`` ("release 13.0, V13.0.88"), or None without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release [^\n]*", text)
    return match.group(0) if match else text.strip().splitlines()[-1]

