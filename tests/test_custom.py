"""Lab 09 custom ops: the LLTM cell in Python, C++ and CUDA C++, and as a torch.library operator.

One C++ build per session (module fixture, private folder, the precompiled torch/extension.h of
the build cache) serves every C++ test; a second, deliberately broken, build fails in the
compiler's front end, with a precompiled header the compiler cannot use. The CUDA source is compiled to PTX
for sm_80 and sm_90 (one nvcc run each); building and running it needs a GPU host.
"""

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autograder.strip import STUB, strip_package
from fastdl_lab import checks
from fastdl_lab.custom import library, lltm, pch, sources
from fastdl_lab.custom.lltm import PYTHON_OPS, LLTMOps, check_ops, lltm_cell, lltm_ref, make_inputs, ops_of

REPO = Path(__file__).resolve().parent.parent
# (batch, input_features, state_size): one of each; input wider than state; odd sizes throughout.
SHAPES = [(1, 1, 1), (5, 3, 7), (2, 11, 6)]
DTYPES = [torch.float64, torch.float32]


@pytest.fixture(scope="module")
def headers():
    """The precompiled torch/extension.h in the build cache, shared with every build of the session."""
    return pch.ensure(sources.OPTIMISE)


@pytest.fixture(scope="module")
def cpp_build(headers, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lltm_cpp")
    return sources.build_cpp(sources.reference_cpp_source(), name="fastdl_lltm_test", build_dir=folder), folder


@pytest.fixture(scope="module")
def cpp(cpp_build):
    return ops_of(cpp_build[0], "cpp")


def _gradcheck(ops: LLTMOps, shape, device="cpu") -> bool:
    inputs = make_inputs(*shape, dtype=torch.float64, seed=sum(shape), device=device, requires_grad=True)
    return torch.autograd.gradcheck(lambda *a: lltm_cell(*a, ops=ops), inputs)


# ---------------------------------------------------------------------------------------------
# The Python forms


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_python_ops_match_reference(shape, dtype):
    check_ops(PYTHON_OPS, make_inputs(*shape, dtype=dtype, seed=1))


@pytest.mark.parametrize("shape", SHAPES)
def test_gradcheck_python_backward(shape):
    assert _gradcheck(PYTHON_OPS, shape)


def test_inputs_reach_both_branches_of_elu():
    # A backward that got ELU's negative side wrong must be caught: the gates cover both signs.
    x, w, b, h, _ = make_inputs(5, 3, 7, dtype=torch.float64, seed=1)
    pre_candidate = torch.addmm(b, torch.cat([h, x], 1), w.t()).chunk(3, 1)[2]
    assert (pre_candidate > 0).any() and (pre_candidate < 0).any()


def test_a_wrong_backward_is_caught():
    def wrong_backward(*args):
        d_old_h, d_input, d_weights, d_bias, d_old_cell = lltm.lltm_backward(*args)
        return [d_old_h, d_input, d_weights, d_bias, d_old_cell * 0.5]

    with pytest.raises(checks.MismatchError, match="d_old_cell"):
        check_ops(LLTMOps(lltm.lltm_forward, wrong_backward, "wrong"), make_inputs(5, 3, 7, dtype=torch.float64))


def test_function_saves_activations_not_a_graph():
    inputs = make_inputs(5, 3, 7, requires_grad=True)
    new_h, new_cell = lltm_cell(*inputs)
    # One autograd node for the whole cell, against a dozen for the reference.
    assert type(new_h.grad_fn).__name__ == "LLTMFunctionBackward"
    assert new_h.grad_fn is new_cell.grad_fn
    saved = new_h.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(5, 7)] * 4 + [(5, 10), (5, 21), (21, 10)]


# ---------------------------------------------------------------------------------------------
# C++


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_matches_reference(cpp, dtype):
    for shape in SHAPES:
        check_ops(cpp, make_inputs(*shape, dtype=dtype, seed=2))


def test_gradcheck_cpp_backward(cpp):
    for shape in SHAPES:
        assert _gradcheck(cpp, shape)


def test_cpp_returns_the_contract(cpp):
    x, w, b, h, c = make_inputs(4, 3, 5)
    forward = cpp.forward(x, w, b, h, c)
    assert [tuple(t.shape) for t in forward] == [(4, 5)] * 5 + [(4, 8), (4, 15)]
    backward = cpp.backward(torch.ones(4, 5), torch.ones(4, 5), *forward[1:], w)
    assert [tuple(t.shape) for t in backward] == [(4, 5), (4, 3), (15, 8), (15,), (4, 5)]


def test_module_backends_agree(cpp):
    torch.manual_seed(0)
    python = lltm.LLTM(6, 4, backend="python")
    compiled = lltm.LLTM(6, 4, backend="cpp", ops=cpp)
    compiled.load_state_dict(python.state_dict())
    x, _, _, h, c = make_inputs(3, 6, 4, seed=3)
    outputs = [m(x, (h, c)) for m in (python, compiled)]
    for m, (new_h, new_cell) in zip((python, compiled), outputs):
        (new_h.sum() + new_cell.square().sum()).backward()
    for a, e in zip(outputs[1], outputs[0]):
        checks.assert_close(a.detach(), e.detach())
    for a, e in zip(compiled.parameters(), python.parameters()):
        checks.assert_close(a.grad, e.grad)
    assert "backend=cpp" in repr(compiled)
    with pytest.raises(ValueError, match="backend"):
        lltm.LLTM(6, 4, backend="fortran")


def _pch_report(build_dir: Path) -> str:
    """g++'s -H report for main.cpp under the build's own compiler (torch's, which honours CXX) and
    flags (from its build.ninja), preprocessing only: the first line is "! FILE.gch" where the
    precompiled header is used. Another GCC would refuse a .gch it did not make."""
    flags = next(line.split("=", 1)[1] for line in (build_dir / "build.ninja").read_text().splitlines()
                 if line.startswith("cflags ="))
    done = subprocess.run([pch._compiler(), "-H", "-E", "-fpch-preprocess", *shlex.split(flags),
                           str(build_dir / "main.cpp"), "-o", os.devnull], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_the_build_takes_torch_extension_h_precompiled(cpp_build, headers):
    _, folder = cpp_build
    assert _pch_report(folder).splitlines()[0] == f"! {headers / pch.HEADER}.gch"
    assert (headers / f"{pch.HEADER}.gch").stat().st_size > 1 << 20


def test_broken_source_gives_the_first_compiler_error(headers, tmp_path, monkeypatch):
    # With a .gch g++ cannot use: it says so, parses the header from its source, and the
    # student's first error is found as without a precompiled header at all.
    unusable = tmp_path / "pch" / pch.key(sources.OPTIMISE)
    (unusable / "torch").mkdir(parents=True)
    (unusable / pch.HEADER).write_text(pch.TENSOR_HEADER)
    (unusable / f"{pch.HEADER}.gch").write_text("not a precompiled header")
    shutil.copy(headers / pch.BINDINGS, unusable / pch.BINDINGS)
    (unusable / pch.KEY_FILE).write_text(pch.key(sources.OPTIMISE))
    monkeypatch.setenv(pch.ENV_VAR, str(unusable.parent))
    broken = sources.reference_cpp_source().replace("torch::sigmoid(gates[1])", "torch::sigmoid(gates[1]) +")
    broken = broken.replace("auto new_h =", "auto new_h = undeclared_name +")
    with pytest.raises(RuntimeError) as failure:
        sources.build_cpp(broken, name="fastdl_lltm_broken", build_dir=tmp_path / "build")
    assert re.search(r"extension\.h\.gch: not a PCH file \[-Winvalid-pch\]", str(failure.value))
    reason = sources.first_compiler_error(str(failure.value))
    assert reason.startswith("main.cpp:") and "error:" in reason, reason
    assert str(tmp_path) not in reason
    # The first error is the dangling '+' (an expression expected before ';'), not the later one.
    line = int(reason.split(":")[1])
    source_lines = ["#include <torch/extension.h>", *broken.splitlines()]
    assert "torch::sigmoid(gates[1]) +" in source_lines[line - 1], (reason, source_lines[line - 1])


def test_without_a_ready_folder_the_build_makes_both_parts_and_builds_the_same(tmp_path, monkeypatch):
    # The build of a machine where pch.ensure never ran: the tensor header parsed from source and
    # the bindings compiled in the build's own folder. Parameters by reference, as many sources
    # write them, reach the bindings through the glue.
    monkeypatch.setenv(pch.ENV_VAR, str(tmp_path / "no-pch"))
    source = sources.reference_cpp_source().replace("torch::Tensor", "const torch::Tensor&")
    source = source.replace("std::vector<const torch::Tensor&>", "std::vector<torch::Tensor>")
    assert "const torch::Tensor& input" in source
    module = sources.build_cpp(source, name="fastdl_lltm_unready", build_dir=tmp_path / "build")
    ninja = (tmp_path / "build" / "build.ninja").read_text()
    assert "bindings.cpp" in ninja and f"-I{tmp_path / 'build' / 'headers'}" in ninja
    ops = ops_of(module, "cpp")
    check_ops(ops, make_inputs(5, 3, 7, dtype=torch.float64, seed=4))
    assert _gradcheck(ops, (2, 11, 6))


def test_a_build_without_a_load_hands_back_the_objects_and_the_unit_as_compiled(headers, tmp_path):
    # What a grader's build child does: compile, import nothing; the shared object is loaded
    # elsewhere, from a copy (a student's sandbox reads the grader's copy of the bytes).
    source = sources.reference_cpp_source().replace("// ELU", "// The candidate's slope: ELU")
    built = sources.build_library(source, name="fastdl_lltm_unloaded", build_dir=tmp_path / "build")
    assert "fastdl_lltm_unloaded" not in sys.modules
    unit = built.preprocessed.read_text()
    assert f"#pragma GCC pch_preprocess \"{headers / pch.HEADER}.gch\"" in unit  # compiled with the shared header
    after = unit.split(sources.SOURCE_BEGINS, 1)[1]
    assert "torch::addmm" in after and "// The candidate" not in after  # preprocessed: comments are gone
    assert " ".join(after.split()).endswith(" ".join(sources.glue("fastdl_lltm_unloaded").split()))
    elsewhere = tmp_path / "elsewhere" / "extension.so"
    elsewhere.parent.mkdir()
    shutil.copy(built.shared_object, elsewhere)
    ops = ops_of(sources.load_library(elsewhere, "fastdl_lltm_unloaded"), "cpp")
    check_ops(ops, make_inputs(5, 3, 7, dtype=torch.float64, seed=4))
    # A failed build raises as build_cpp's does, its first error on the source's own line + 1.
    with pytest.raises(RuntimeError) as failure:
        sources.build_library(source.replace("auto new_h =", "auto new_h = undeclared +"), name="fastdl_lltm_unloaded",
                              build_dir=tmp_path / "broken")
    reason = sources.first_compiler_error(str(failure.value))
    line = int(reason.split(":")[1])
    assert "undeclared" in ["#include <torch/extension.h>", *source.replace(
        "auto new_h =", "auto new_h = undeclared +").splitlines()][line - 1], reason


def test_a_source_sees_the_tensor_api_only(headers, tmp_path):
    # What "#include <torch/extension.h>" gives a source: ATen and torch:: tensors, not the
    # Python side (pybind11) a source of the course never needs.
    source = sources.reference_cpp_source() + "\nstatic pybind11::object nothing;\n"
    with pytest.raises(RuntimeError) as failure:
        sources.build_cpp(source, name="fastdl_lltm_pybind", build_dir=tmp_path / "build")
    assert "pybind11" in sources.first_compiler_error(str(failure.value))


@pytest.mark.parametrize("text, expected", [
    ("ninja: error: loading 'build.ninja'\n", "ninja: error: loading 'build.ninja'"),
    ("FAILED: cuda.cuda.o\n/tmp/b/x/cuda.cu(42): error: identifier \"y\" is undefined\n\n1 error detected\n",
     'cuda.cu(42): error: identifier "y" is undefined'),
    ("/usr/bin/ld: main.o: in function `f':\nmain.cpp:(.text+0x1): undefined reference to `g'\n"
     "collect2: error: ld returned 1 exit status\n", "main.cpp:(.text+0x1): undefined reference to `g'"),
    ("/root/.cache/fastdl_x.so: undefined symbol: _Z13lltm_backwardN2at6TensorE",
     "fastdl_x.so: undefined symbol: _Z13lltm_backwardN2at6TensorE"),
    ("\x1b[01;31merror:\x1b[0m bad\n", "error: bad"),
    ("", "(no output)"),
])
def test_first_compiler_error_reads_each_tool(text, expected):
    assert sources.first_compiler_error(text) == expected


# ---------------------------------------------------------------------------------------------
# CUDA without a GPU


@pytest.mark.skipif(sources.find_nvcc() is None, reason="no nvcc on PATH or in /usr/local/cuda/bin: "
                    "the CUDA source cannot be compiled on this machine")
@pytest.mark.parametrize("capability", [80, 90])
def test_cuda_source_compiles_to_ptx(capability):
    ptx = sources.compile_cuda(capability).decode()
    assert re.search(rf"^\.target sm_{capability}\b", ptx, re.M)
    entries = re.findall(r"^(?:\.visible )?\.entry (\w+)\(", ptx, re.M)
    # Both kernels, each for float (If) and double (Id): AT_DISPATCH_FLOATING_TYPES's two types.
    kernels = sorted(" ".join(m) for e in entries for m in re.findall(r"(lltm_(?:forward|backward)_kernel)I([fd])E", e))
    assert len(entries) == 4 and kernels == [
        "lltm_backward_kernel d", "lltm_backward_kernel f", "lltm_forward_kernel d", "lltm_forward_kernel f"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_build_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a GPU host"):
        sources.build_cuda(name="fastdl_lltm_cuda_test")


@pytest.mark.gpu
def test_cuda_extension_matches_reference(tmp_path):
    cuda = ops_of(sources.build_cuda(name="fastdl_lltm_cuda_test", build_dir=tmp_path), "cuda")
    for dtype in DTYPES:
        for shape in SHAPES + [(16, 32, 128)]:
            check_ops(cuda, make_inputs(*shape, dtype=dtype, seed=4, device="cuda"))
    assert _gradcheck(cuda, (5, 3, 7), device="cuda")


# ---------------------------------------------------------------------------------------------
# torch.library


def _loss(fn):
    def loss(*inputs):
        new_h, new_cell = fn(*inputs)
        return (new_h * new_cell).sum() + new_cell.sum()
    return loss


def test_op_passes_opcheck():
    # opcheck: the schema, the fake implementation against the real one, the autograd
    # registration, and tracing by AOTAutograd with dynamic shapes.
    inputs = make_inputs(5, 3, 7, dtype=torch.float64, seed=6, requires_grad=True)
    _, weights, _, grad_h, grad_cell = make_inputs(5, 3, 7, dtype=torch.float64, seed=7)
    activations = PYTHON_OPS.forward(*[t.detach() for t in inputs])[1:]
    for op, args in ((torch.ops.fastdl.lltm_forward.default, inputs),
                     (torch.ops.fastdl.lltm_backward.default, [grad_h, grad_cell, *activations, weights])):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, results


def test_gradcheck_through_the_op():
    inputs = make_inputs(4, 6, 5, dtype=torch.float64, seed=7, requires_grad=True)
    assert torch.autograd.gradcheck(library.lltm_op, inputs)


def test_op_runs_the_installed_backend(cpp):
    calls = []

    def counting_forward(*args):
        calls.append("forward")
        return cpp.forward(*args)

    inputs = make_inputs(5, 3, 7, dtype=torch.float64, seed=8, requires_grad=True)
    assert library.current_ops("cpu") is PYTHON_OPS
    with library.using_ops(LLTMOps(counting_forward, cpp.backward, "counting cpp")):
        outputs = library.lltm_op(*inputs)
        grads = torch.autograd.grad(outputs, inputs, [torch.ones_like(t) for t in outputs])
    assert calls == ["forward"] and library.current_ops("cpu") is PYTHON_OPS
    reference = lltm_ref(*inputs)
    for a, e in zip((*outputs, *grads), (*reference, *torch.autograd.grad(
            reference, inputs, [torch.ones_like(t) for t in reference]))):
        checks.assert_close(a.detach(), e.detach())


def test_op_copies_results_that_share_memory():
    # The tutorial's backward slices one d_X for both d_old_h and d_input: an operator may not
    # return that, so the op copies whichever result shares memory with another or an input.
    def sliced_backward(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights,
                        weights):
        d_old_h, d_input, d_weights, d_bias, d_old_cell = lltm.lltm_backward(
            grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights)
        d_X = torch.cat([d_old_h, d_input], dim=1)
        state = grad_h.shape[1]
        return [d_X[:, :state], d_X[:, state:], d_weights, d_bias, d_old_cell]

    inputs = make_inputs(5, 3, 7, dtype=torch.float64, seed=9, requires_grad=True)
    with library.using_ops(LLTMOps(lltm.lltm_forward, sliced_backward, "sliced")):
        outputs = library.lltm_op(*inputs)
        grads = torch.autograd.grad(outputs, inputs, [torch.ones_like(t) for t in outputs])
    expected = torch.autograd.grad(lltm_ref(*inputs), inputs, [torch.ones_like(t) for t in outputs])
    for a, e in zip(grads, expected):
        checks.assert_close(a, e)


def test_compile_traces_the_op_in_one_graph():
    inputs = make_inputs(5, 3, 7, dtype=torch.float64, seed=10, requires_grad=True)
    fn = _loss(library.lltm_op)
    explanation = torch._dynamo.explain(fn)(*inputs)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    assert "torch.ops.fastdl.lltm_forward" in explanation.graphs[0].code
    # aot_eager traces forward and backward on fake tensors (the fake implementations and
    # register_autograd at work) as inductor would, without inductor's code generation.
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(*inputs)
    want = fn(*inputs)
    checks.assert_close(got, want)
    for a, e in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        checks.assert_close(a, e)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")
def test_extension_function_needs_the_op_to_compile(cpp):
    inputs = make_inputs(5, 3, 7, dtype=torch.float64, seed=11, requires_grad=True)
    torch._dynamo.reset()
    # Dynamo cannot look inside a pybind11 function, so an autograd.Function that calls one
    # cannot be part of a graph; the same C++ behind the registered op can.
    with pytest.raises(torch._dynamo.exc.Unsupported, match="pybind"):
        torch.compile(_loss(lambda *a: lltm_cell(*a, ops=cpp)), fullgraph=True, backend="eager")(*inputs)
    torch._dynamo.reset()
    with library.using_ops(cpp):
        got = torch.compile(_loss(library.lltm_op), fullgraph=True, backend="eager")(*inputs)
    checks.assert_close(got, _loss(lltm_ref)(*inputs))


# ---------------------------------------------------------------------------------------------
# The graded region


def test_only_build_cpp_calls_the_reference_source():
    callers = set()
    for path in (REPO / "fastdl_lab").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef):
                for node in ast.walk(func):
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "reference_cpp_source":
                        callers.add(func.name)
    assert callers == {"build_cpp"}


def test_student_copy_hides_the_source_and_still_serves_the_grader(tmp_path):
    strip_package(REPO / "fastdl_lab", tmp_path / "fastdl_lab")
    stripped = (tmp_path / "fastdl_lab" / "custom" / "sources.py").read_text()
    assert "torch::addmm" not in stripped and STUB in stripped
    assert sources.CUDA_SOURCE in stripped
    script = ("import fastdl_lab.custom as c\n"
              "c.check()\n"
              "try:\n    c.reference_cpp_source()\nexcept NotImplementedError:\n    print('hidden')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("custom: checks passed") and done.stdout.splitlines()[-1] == "hidden"
