"""What a student's C++ extension may contain, judged on what the compiler saw and what the linker
was left to find: the grader's side of lab 09's ``cpp_lltm``.

The source's text is not what is compiled: macros, token pasting (``Py ## Run_SimpleString``) and
headers turn it into something else. So the grader judges two things the build hands back (never
the source as written):

- the **preprocessed unit** (``g++ -save-temps``: the text the compiler compiled), from the line
  after ``sources.SOURCE_BEGINS`` (everything before it is torch's tensor header) to the end,
  which must be exactly ``sources.glue(name)``, the part the build adds: a source that redefines
  one of its words is refused. What lies between is the source with every macro expanded and
  every header it added; no word of it may name Python's C API or torch's Python bindings, the
  dynamic loader, the process, file and environment calls, inline assembly, linker attributes or
  pragmas, or autograd's entry points (the backward is written by hand);
- the **symbols the objects leave undefined**, read by ``autograder.engine.elf`` from the bytes: the
  source's object file may only leave to others ATen, c10, the C++ runtime and a short list of C
  functions (memory, strings, mathematics), never autograd's entry points; the shared object may
  leave nothing else undefined but what the course's own bindings need.

Both are screens of what the student's code names, a second line: a native function can still
find any other by its address at run time. The item's score rests on the values the parent
recomputes.
"""

from __future__ import annotations

import re

from autograder.engine import elf
from autograder.engine.items import BuildRefused


class CppRefused(BuildRefused):
    """The built extension reaches past what the item allows; the message says what and where."""


# --- the preprocessed unit ------------------------------------------------------------------------

MAX_PREPROCESSED = 64 << 20
# A token of C++ after preprocessing. Literals are kept whole so that what they say is never
# taken for a name (a message may say "Python"); GCC accepts $ in names.
_TOKEN = re.compile(r"""
    (?P<raw>(?:u8|[uUL])?R"(?P<delim>[^()\\\s]{0,16})\(.*?\)(?P=delim)")
  | (?P<string>(?:u8|[uUL])?"(?:[^"\\\n]|\\.)*")
  | (?P<char>(?:u8|[uUL])?'(?:[^'\\\n]|\\.)*')
  | (?P<number>\.?\d(?:[eEpP][+-]|[\w.']|\$)*)
  | (?P<name>[A-Za-z_$][\w$]*)
  | (?P<punct>\S)
""", re.S | re.X)
# What g++ writes into its preprocessed output that is not code: line markers (# 12 "file" 2), and
# the warning switches ATen's dispatch macros expand to (_Pragma("GCC diagnostic ...")). Every
# other directive stays, and is refused.
_NOT_CODE = re.compile(r'^(?:# \d+ "(?:[^"\\\n]|\\.)*"(?: [1-4])*'
                       r'|#pragma GCC diagnostic (?:push|pop|(?:ignored|warning) "-W[\w+=-]*"))$', re.M)

# Python's C API (Py..., _Py..., PY...), torch's Python bindings (THP...), pybind11 and the struct
# behind PyObject.
_PYTHON = re.compile(r"Py[A-Z_]|^_Py|^PY[A-Z_]|^THP[A-Z]|pybind11|^_object$")
_REFUSED_WORDS = {
    "the dynamic loader": {"dlopen", "dlmopen", "dlsym", "dlvsym", "dladdr", "dladdr1", "dlinfo", "dlerror", "dlclose",
                           "dl_iterate_phdr"},
    "processes": {"system", "popen", "pclose", "fork", "vfork", "clone", "clone3", "execl", "execlp", "execle", "execv",
                  "execvp", "execvpe", "execve", "execveat", "fexecve", "posix_spawn", "posix_spawnp", "syscall",
                  "ptrace", "kill", "tgkill", "prctl"},
    "the environment": {"getenv", "secure_getenv", "setenv", "putenv", "unsetenv", "clearenv", "environ", "__environ"},
    "files": {"fopen", "fopen64", "freopen", "fdopen", "open", "open64", "openat", "creat", "fstream", "ofstream",
              "ifstream", "basic_fstream", "basic_ofstream", "basic_ifstream", "filebuf", "basic_filebuf", "filesystem",
              "unlink", "unlinkat", "rmdir", "mkdir", "chmod", "chown", "symlink", "mmap", "mprotect", "socket",
              "connect", "sendmsg", "sendto", "atexit", "at_quick_exit", "signal", "sigaction"},
    "inline assembly or linker attributes": {"asm", "__asm", "__asm__", "__attribute__", "__attribute", "__declspec",
                                             "constructor", "__constructor__", "destructor", "__destructor__",
                                             "section", "__section__", "alias", "__alias__", "ifunc", "__ifunc__",
                                             "weakref", "__weakref__", "weak", "__weak__", "symver", "__symver__",
                                             "init_priority", "__init_priority__", "visibility", "__visibility__"},
    "torch's dispatcher by name (an op named in a string)": {"Dispatcher", "OperatorHandle", "findSchema",
                                                              "findSchemaOrThrow", "findOp", "callBoxed"},
    "autograd (the backward is yours to write)": {"autograd", "backward", "_backward", "requires_grad",
                                                  "requires_grad_", "set_requires_grad", "retain_grad", "grad_fn",
                                                  "_fw_grad", "_set_fw_grad", "_make_dual", "_unpack_dual",
                                                  "_fw_primal", "GradMode", "AutoGradMode", "AutogradState", "jit"},
}
_REFUSED = {word: what for what, words in _REFUSED_WORDS.items() for word in words}


def tokens(text: str) -> list[tuple[str, str]]:
    """The tokens of preprocessed C++ (line markers and warning switches dropped), literals whole:
    (kind, text) pairs, kind one of raw, string, char, number, name and punct."""
    return [(m.lastgroup, m.group(0)) for m in _TOKEN.finditer(_NOT_CODE.sub("", text))]


def _refusal(token: str) -> str | None:
    if _PYTHON.search(token):
        return "Python's C API or torch's Python bindings"
    return _REFUSED.get(token)


def screen_preprocessed(text: str, begins: str, glue: str) -> None:
    """Refuse the unit ``text`` (what g++ compiled) unless the source between ``begins`` and the
    ``glue`` the build appended names nothing the item refuses."""
    if len(text) > MAX_PREPROCESSED:
        raise CppRefused(f"the preprocessed source has {len(text) >> 20} MiB, more than a source of the cell needs")
    start = text.find(begins)
    if start < 0:
        raise CppRefused("the preprocessed source lacks the line the build puts before the source")
    found = tokens(text[start + len(begins):])
    ending = tokens(glue)
    if len(found) < len(ending) or found[len(found) - len(ending):] != ending:
        raise CppRefused("after the source, the functions the build adds do not read as written: does the source "
                         "define a macro it does not undefine, or leave a comment, brace or #if open?")
    for kind, token in found[:len(found) - len(ending)]:
        if token in ("#", "%:"):
            raise CppRefused("the source leaves a directive for the compiler (#pragma or _Pragma): not allowed")
        if kind != "name":
            continue
        what = _refusal(token)
        if what:
            raise CppRefused(f"after preprocessing, the source names {token!r} ({what}): the cell computes with "
                             "ATen, nothing else")


# --- the symbols left undefined -------------------------------------------------------------------

# C functions an ATen source may leave to the C and C++ runtimes: memory and strings, mathematics,
# exceptions and static initialisation, and what the compiler itself inserts.
_C_ALLOWED = frozenset({
    "_GLOBAL_OFFSET_TABLE_", "_Unwind_Resume", "__gxx_personality_v0", "__dso_handle", "__libc_single_threaded",
    "__stack_chk_fail", "__tls_get_addr", "__gmon_start__", "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable",
    "__assert_fail", "abort", "memcpy", "memmove", "memset", "memcmp", "memchr", "strlen", "strcmp", "strncmp",
    "strchr", "strrchr", "strstr", "__memcpy_chk", "__memmove_chk", "__memset_chk", "__strlen_chk", "snprintf",
    "vsnprintf", "__snprintf_chk", "__vsnprintf_chk", "printf", "__printf_chk", "puts", "putchar",
    *(f"{name}{suffix}" for name in (
        "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "copysign", "cos", "cosh", "erf",
        "erfc", "exp", "exp2", "expm1", "fabs", "floor", "fma", "fmax", "fmin", "fmod", "frexp", "hypot", "ldexp",
        "lgamma", "log", "log10", "log1p", "log2", "logb", "lrint", "lround", "modf", "nearbyint", "nextafter", "pow",
        "remainder", "rint", "round", "scalbn", "sin", "sinh", "sqrt", "tan", "tanh", "tgamma", "trunc")
      for suffix in ("", "f")),
})
# The C++ runtime's own functions, exceptions and guards (``__cxa_atexit`` runs a static object's
# destructor, the source's own code).
_CXA = re.compile(r"^__cxa_[a-z_]+$")
# Top-level C++ namespaces whose functions a source may call: ATen, c10 (and caffe2's type
# metadata), the standard library and its ABI, and operator new and delete.
_NAMESPACES = frozenset({"at", "c10", "caffe2", "std", "__gnu_cxx", "__cxxabiv1"})
_OPERATORS = re.compile(r"^_Z(?:nw|na|dl|da)[A-Za-z]")
# torch:: holds the Python bindings, the JIT and autograd. A source's inline tensor code needs
# autograd's metadata class (its vtable and type), made when a factory function builds a tensor,
# and torch's header-only helpers; nothing else of torch::.
_TORCH_ALLOWED = re.compile(r"^_ZT[VIS]N5torch8autograd12AutogradMetaE$|^_ZN?K?5torch10headeronly")
# Names inside an allowed namespace that reach autograd, the JIT, Python, the dispatcher by an op's
# name (which a string can hold: any op, autograd's included), or files.
_DENIED_PARTS = frozenset({
    "Dispatcher", "OperatorHandle", "findSchema", "findSchemaOrThrow", "findOp", "callBoxed",
    "autograd", "backward", "_backward", "requires_grad_", "set_requires_grad", "retain_grad", "grad_fn", "_fw_grad",
    "_set_fw_grad", "_make_dual", "_unpack_dual", "_fw_primal", "GradMode", "AutoGradMode", "AutogradState", "jit",
    "python", "PythonTLSSnapshot", "PythonDispatcherTLS", "SafePyObject", "basic_fstream", "basic_ofstream",
    "basic_ifstream", "basic_filebuf", "filesystem", "thread", "system",
})
# The one undefined name of the source's unit that is the build's own: the bindings' entry point,
# which the glue's entry hands over to.
_GLUE_NEEDS = frozenset({"PyInit_fastdl_lltm_bindings"})
# Libraries a shared object of the course links: torch's and the C and C++ runtimes.
_LIBRARIES = re.compile(r"^(?:libc10|libtorch|libtorch_cpu|libtorch_python|libstdc\+\+|libgcc_s|libc|libm"
                        r"|ld-linux[\w.-]*)\.so(?:\.\d+)*$")
MAX_MANGLED = 4096


def _mangled_parts(name: str) -> list[str]:
    """The source names (<length><identifier>) of an Itanium-mangled name, in order, and "std" for
    the standard library's abbreviations. A reading that loses its way takes a few odd parts, never
    fewer of the real ones after it."""
    parts, i = [], 2
    while i < len(name):
        if name.startswith("St", i) or (name[i] == "S" and i + 1 < len(name) and name[i + 1] in "abiosd"):
            parts.append("std")
            i += 2
            continue
        if name[i].isdigit():
            j = i
            while j < len(name) and name[j].isdigit():
                j += 1
            size = int(name[i:j][:6])
            parts.append(name[j:j + size])
            i = j + size
            continue
        i += 1
    return parts


def _scope(name: str) -> str:
    """The first part of a mangled name's scope (after a vtable, typeinfo or guard prefix)."""
    body = re.sub(r"^_Z(?:T[VISTHW]|GV)?N?[rVKRO]*", "", name)
    if body.startswith("St") or (len(body) > 1 and body[0] == "S" and body[1] in "abiosd"):
        return "std"
    match = re.match(r"(\d+)", body)
    if not match:
        return ""
    size = int(match.group(1)[:6])
    return body[match.end():match.end() + size]


def symbol_problem(name: str, also: frozenset[str] = frozenset()) -> str | None:
    """Why an undefined symbol ``name`` may not be left for others to provide, or None."""
    if name in also:
        return None
    if len(name) > MAX_MANGLED:
        return "a name longer than any the course's headers make"
    if not name.startswith("_Z"):
        if name in _C_ALLOWED or _CXA.match(name):
            return None
        if _PYTHON.search(name):
            return "Python's C API"
        return "not among the C functions a source of tensor arithmetic needs"
    if _OPERATORS.match(name):
        return None
    scope = _scope(name)
    if scope == "torch":
        return None if _TORCH_ALLOWED.match(name) else "torch's Python bindings, JIT or autograd"
    if scope not in _NAMESPACES:
        return "a function outside ATen, c10 and the C++ library"
    parts = _mangled_parts(name)
    denied = sorted(_DENIED_PARTS.intersection(parts)) or [part for part in parts if "ython" in part]
    if denied:
        return f"it reaches {denied[0]}"
    return None


def screen_symbols(unit: bytes, shared_object: bytes, bindings_undefined: frozenset[str]) -> None:
    """Refuse the build unless the source's object file leaves to others only what ``symbol_problem``
    allows, and the shared object only that and what the course's bindings need."""
    try:
        in_unit = elf.undefined_symbols(unit)
        in_library = elf.undefined_symbols(shared_object)
        libraries = elf.needed_libraries(shared_object)
    except elf.ElfError as exc:
        raise CppRefused(f"the build's output is not an object the grader reads: {exc}") from None
    for name in in_unit:
        problem = symbol_problem(name, _GLUE_NEEDS)
        if problem:
            raise CppRefused(f"the compiled source calls {name[:120]} ({problem}): the cell computes with ATen, "
                             "nothing else")
    for name in in_library:
        problem = symbol_problem(name, bindings_undefined)
        if problem:
            raise CppRefused(f"the built extension needs {name[:120]} ({problem}), which neither the source nor the "
                             "course's bindings call")
    odd = [lib for lib in libraries if not _LIBRARIES.match(lib)]
    if odd:
        raise CppRefused(f"the built extension asks the loader for {odd[0][:80]}, not one of torch's libraries")
