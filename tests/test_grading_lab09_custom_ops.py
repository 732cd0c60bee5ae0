"""Lab 09's C++ screen: what the compiler saw and what the objects leave undefined, judged by the
grader (``autograder/labs/_cpp_screen.py``). Builds of hostile sources are graded end to end, in
the sandbox, by ``tests/adversarial``; these tests feed the screen text and names directly."""

import shutil
import subprocess

import pytest

from autograder.engine.items import BuildRefused
from autograder.labs import _cpp_screen
from autograder.labs._cpp_screen import CppRefused, screen_preprocessed, symbol_problem
from fastdl_lab.custom import sources

GLUE = sources.glue("student_lltm")
HEADER = ('# 1 "/job/x/main.cpp"\n#pragma GCC pch_preprocess "/opt/fastdl/pch/k/torch/extension.h.gch"\n'
          f"{sources.SOURCE_BEGINS}\n# 2 \"/job/x/main.cpp\"\n")
HONEST = r'''
std::vector<torch::Tensor> lltm_forward(const torch::Tensor& input) {
  if ((__builtin_expect(static_cast<bool>(!(input.dim() == 2)), 0))) {
    ::c10::detail::torchCheckFail(__func__, "main.cpp", static_cast<uint32_t>(4), "Python-style message: 2-D");
  }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wswitch-enum"
  auto raw = R"doc(PyRun_SimpleString is only words in a string)doc";
  const long big = 1'000'000;
  return {at::sigmoid(input)};
}
'''


def unit(source: str, glue: str = GLUE) -> str:
    return f"{HEADER}{source}\n{glue}"


def test_an_honest_unit_passes_with_its_macros_strings_and_warning_switches():
    screen_preprocessed(unit(HONEST), sources.SOURCE_BEGINS, GLUE)


@pytest.mark.parametrize("line, named", [
    ('PyRun_SimpleString("import os");', "PyRun_SimpleString"),
    ("auto* w = THPVariable_Wrap(t);", "THPVariable_Wrap"),
    ("void* h = dlopen(0, 2);", "dlopen"),
    ("char* e = getenv(\"HOME\");", "getenv"),
    ("__attribute__((constructor)) static void f() {}", "__attribute__"),
    ("[[gnu::constructor]] static void f() {}", "constructor"),
    ('asm volatile("syscall");', "asm"),
    ("out.backward(grad);", "backward"),
    ("c10::AutoGradMode on(true);", "AutoGradMode"),
    ("auto g = torch::autograd::grad({y}, {x});", "autograd"),
    ('auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::_backward", "");', "Dispatcher"),
])
def test_every_refused_name_is_caught_after_preprocessing(line, named):
    with pytest.raises(CppRefused, match=f"'{named}'"):
        screen_preprocessed(unit(HONEST.replace("return {", line + "\n  return {")), sources.SOURCE_BEGINS, GLUE)


def test_directives_left_for_the_compiler_are_refused_but_line_markers_are_not():
    with pytest.raises(CppRefused, match="directive"):
        screen_preprocessed(unit("#pragma weak lltm_forward = evil\n" + HONEST), sources.SOURCE_BEGINS, GLUE)
    screen_preprocessed(unit('# 40 "/usr/include/c++/12/vector" 1 3\n' + HONEST), sources.SOURCE_BEGINS, GLUE)


def test_a_glue_the_source_changed_is_refused():
    changed = GLUE.replace("PyInit_fastdl_lltm_bindings()", "evil()", 1)
    with pytest.raises(CppRefused, match="do not read as written"):
        screen_preprocessed(unit(HONEST, changed), sources.SOURCE_BEGINS, GLUE)
    with pytest.raises(CppRefused, match="lacks the line"):
        screen_preprocessed(unit(HONEST).replace(sources.SOURCE_BEGINS, ""), sources.SOURCE_BEGINS, GLUE)
    assert issubclass(CppRefused, BuildRefused)


# Names the reference's object file leaves undefined (g++ 12, torch 2.13), a sample of every kind.
HONEST_SYMBOLS = [
    "_ZN2at4_ops7sigmoid4callERKNS_6TensorE", "_ZN2at4_ops3cat4callERKN3c108IListRefINS_6TensorEEEl",
    "_ZN3c106detail14torchCheckFailEPKcS2_jS2_", "_ZN3c104impl22getGlobalPyInterpreterEv",
    "_ZNK3c1010TensorImpl15incref_pyobjectEv", "_ZN6caffe28TypeMeta26error_unsupported_typemetaES0_",
    "_ZTVN5torch8autograd12AutogradMetaE", "_ZTVN10__cxxabiv117__class_type_infoE", "_ZSt9terminatev",
    "_ZNSt8ios_base4InitC1Ev", "_ZdlPvm", "_Znwm", "__cxa_atexit", "__gxx_personality_v0", "_Unwind_Resume",
    "memcpy", "strlen", "_GLOBAL_OFFSET_TABLE_", "__dso_handle", "tanh", "expf",
    "_ZN2at4_ops13tanh_backward4callERKNS_6TensorES4_",  # ATen's derivative formulas are allowed
]


def test_what_honest_aten_code_leaves_undefined_is_allowed():
    assert {name: symbol_problem(name) for name in HONEST_SYMBOLS} == dict.fromkeys(HONEST_SYMBOLS)


@pytest.mark.parametrize("name", [
    "PyRun_SimpleString", "PyImport_ImportModule", "dlopen", "dlsym", "system", "getenv", "fopen", "rename", "write",
    "_Z16THPVariable_WrapRKN2at10TensorBaseE",
    "_ZN5torch8autograd8backwardERKSt6vectorIN2at6TensorESaIS3_EES7_St8optionalIbEbS7_",
    "_ZNK2at6Tensor9_backwardEN3c108ArrayRefIS0_EERKSt8optionalIS0_ES4_IbEb",
    "_ZNK2at10TensorBase14requires_grad_Eb", "_ZN3c108GradMode11set_enabledEb",
    "_ZNSt14basic_ofstreamIcSt11char_traitsIcEEC1EPKcSt13_Ios_Openmode",
    "_ZN5torch3jit6ModuleD1Ev", "_ZN8pybind116module_6importEPKc",
    "_ZN3c1010Dispatcher17findSchemaOrThrowEPKcS2_", "_ZN2at4impl22PythonTorchFunctionTLS9get_stateEv",
])
def test_what_reaches_python_the_loader_the_system_or_autograd_is_not(name):
    assert symbol_problem(name)


def test_the_glue_and_the_bindings_may_leave_their_own_names():
    assert symbol_problem("PyInit_fastdl_lltm_bindings")
    assert symbol_problem("PyInit_fastdl_lltm_bindings", _cpp_screen._GLUE_NEEDS) is None
    assert symbol_problem("PyObject_GetAttrString", frozenset({"PyObject_GetAttrString"})) is None


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_objects_bytes_are_judged(tmp_path):
    (tmp_path / "u.c").write_text('extern void* dlopen(const char*, int);\nvoid* f(void) { return dlopen("x", 1); }\n')
    subprocess.run(["cc", "-c", "-fPIC", "u.c", "-o", "u.o"], cwd=tmp_path, check=True)
    subprocess.run(["cc", "-shared", "u.o", "-o", "u.so"], cwd=tmp_path, check=True)
    unit_bytes, library = (tmp_path / "u.o").read_bytes(), (tmp_path / "u.so").read_bytes()
    with pytest.raises(CppRefused, match="calls dlopen"):
        _cpp_screen.screen_symbols(unit_bytes, library, frozenset())
    with pytest.raises(CppRefused, match="not an object the grader reads"):
        _cpp_screen.screen_symbols(b"\x7fELF" + bytes(100), library, frozenset())
