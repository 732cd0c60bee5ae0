"""Graded Python artefacts: only screened classes, functions and constants leave their cells."""

import pytest

from autograder.engine import artefacts, reach
from autograder.engine.artefacts import ArtefactRejected
from autograder.engine.reach import SAFE_BUILTINS

HONEST = '''
import torch
from fastdl_lab.optim import multi_tensor_table

BLOCK = 256
torch.set_num_threads(1)
print("top-level code never reaches the grader")


def helper(x):
    return x * 2


class Scaler:
    def __init__(self, device="cpu", init_scale=2.0**16):
        self._scale = float(init_scale)
        self._tracker = 0

    def get_scale(self):
        return self._scale

    @torch.no_grad()
    def unscale_(self, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self._scale)
                    assert torch.isfinite(p.grad).all() or True


class Optimizer(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))
'''


LIBRARY = r"^amp$|scaler|adam"  # lab 04's


def _module(source, required=("Scaler",)):
    return artefacts.extract([source], required, LIBRARY)


def test_keeps_definitions_and_literal_constants_and_drops_the_rest():
    module = _module(HONEST, ("Scaler", "helper", "Optimizer"))
    assert "BLOCK = 256" in module and "class Scaler" in module and "def helper" in module
    assert "import" not in module and "print(" not in module and "set_num_threads" not in module


def test_constants_unpacked_from_a_tuple_are_kept():
    module = artefacts.extract(["A, B = 16, 2.5\nC, f = 1, print\ndef f():\n    return A + B\n"], ("f",))
    assert "A, B = (16, 2.5)" in module and "print" not in module


def test_kernels_are_left_to_the_kernel_extractor():
    source = "import triton\n@triton.jit\ndef k(x_ptr):\n    pass\n\ndef f():\n    return 1\n"
    module = artefacts.extract([source], ("f",))
    assert "def k" not in module and "def f" in module


@pytest.mark.parametrize("body, why", [
    ("import torch.amp", "imports"),
    ("from torch.amp import GradScaler", "imports"),
    ("return torch.amp.GradScaler('cpu')", ".GradScaler"),
    ("return torch.cuda.amp", ".amp"),
    ("return torch.optim.AdamW([x])", ".AdamW"),
    ("return optim.adamw_foreach", ".adamw_foreach"),
    ("return amp_module.DynamicLossScaler()", "DynamicLossScaler"),
    ("return torch._amp_update_scale_", "._amp_update_scale_"),
    ("return torch._C", "._C"),
    ("return torch.ops.aten", ".ops"),
    ("return getattr(torch, 'a' + 'mp')", "getattr"),
    ("return eval('torch.amp')", "eval"),
    ("return x.__class__", ".__class__"),
    ("return __import__('os')", "__import__"),
    ("return globals()", "globals"),
    ("global BLOCK\n    BLOCK = 1", "global"),
    ("return torch.serialization.sys", ".sys"),
    ("return x.grad._base", "._base"),
    ("torch.Tensor.item = lambda t: 0.0", "assigning .item"),
    ("x.parameters = list", "assigning .parameters"),
    ("type(x).tolist = list", "assigning .tolist"),
    ("del torch.Tensor.numpy", "assigning .numpy"),
    ("x.count += 1", "assigning .count"),
    ("torch.Tensor.grad = None", "assigning .grad"),
    ("type(x).grad = None", "assigning .grad"),
    ("del x.grad", "assigning .grad"),
    ("return torch.multiprocessing", ".multiprocessing"),
    ("return torch.serialization.pickle", ".pickle"),
    ("return dist.recv_object_list(x)", ".recv_object_list"),
    ("return torch.utils.cpp_extension", ".cpp_extension"),
    ("return x.numpy().tofile('payload.so')", ".tofile"),
    ("return torch.autograd.gc", ".gc"),
    # Syntax that reads attributes by name without an attribute node.
    ("match x:\n        case object(__class__=c):\n            return c", "Match"),
    ("return '{0.__class__}'.format(x)", ".format"),
    ("return str.format_map('{a.__dict__}', {'a': x})", ".format_map"),
    ("async def g():\n        yield 1\n    return g().ag_frame", "AsyncFunctionDef"),
    ("return (y for y in x).gi_frame.f_back", ".f_back"),
    ("class A(object, metaclass=type):\n        pass", "metaclass"),
    ("return x.f_builtins", ".f_builtins"),
])
def test_screen_refuses_ways_out(body, why):
    source = f"def f(x):\n    {body}\n"
    with pytest.raises(ArtefactRejected, match=why.replace(".", r"\.").replace("(", r"\(")) as info:
        artefacts.extract([source], ("f",), LIBRARY)
    assert "function f, line" in str(info.value)


def test_screen_covers_methods_decorators_defaults_and_class_bodies():
    for source in ("class C:\n    x = torch.amp\n",
                   "class C:\n    @torch.amp.custom_fwd\n    def f(self):\n        pass\n",
                   "def f(x=torch.amp):\n    return x\n",
                   "class C(torch.amp.GradScaler):\n    pass\n"):
        with pytest.raises(ArtefactRejected, match=r"\.amp|\.GradScaler"):
            artefacts.extract([source], (), LIBRARY)


def test_the_library_pattern_is_the_items_own():
    # sklearn's StandardScaler is fair game where the graded technique is not a loss scaler.
    source = "def f(x):\n    return sklearn.preprocessing.StandardScaler().fit_transform(x)\n"
    assert "StandardScaler" in artefacts.extract([source], ("f",))
    with pytest.raises(ArtefactRejected, match="StandardScaler"):
        artefacts.extract([source], ("f",), LIBRARY)
    with pytest.raises(ArtefactRejected, match="other modules"):
        artefacts.extract(["def f():\n    return torch.serialization.sys\n"], ("f",))


def test_own_private_attributes_are_allowed():
    module = artefacts.extract(["class C:\n    def f(self):\n        self._adam_state = self._x\n"], ("C",), LIBRARY)
    assert "self._adam_state" in module


def test_an_autograd_context_holds_state_like_self():
    source = ("class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x, n):\n"
              "        ctx.n = n\n        ctx.save_for_backward(x)\n        return x\n")
    assert "ctx.n = n" in artefacts.extract([source], ("F",), LIBRARY)
    with pytest.raises(ArtefactRejected, match="assigning .n"):
        artefacts.extract([source.replace("ctx.n = n", "context.n = n")], ("F",), LIBRARY)


def test_a_gradient_may_be_set_through_a_variable():
    source = ("def sync(params, n):\n    for p in params:\n        p.grad /= n\n    params[0].grad = None\n")
    assert "p.grad /= n" in artefacts.extract([source], ("sync",), LIBRARY)


# What the screen cannot see: a variable that names a class. The descriptors that assignment
# would replace are instruments of every extracted item, checked after the run.
_REPLACED_GRAD = """
import torch
from autograder.engine import artefacts, child
instruments = child._Instruments(artefacts.GRAD_DESCRIPTORS)
instruments.verify()
T = torch.nn.Parameter
T.grad = property(lambda self: None)
try:
    instruments.verify()
except child.Tampered as exc:
    print("tampered:", exc)
"""


def test_a_replaced_grad_descriptor_is_tampered():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _REPLACED_GRAD], capture_output=True, text=True, timeout=120, check=True)
    assert "tampered: the instrument torch.nn.Parameter.grad was replaced" in done.stdout


def test_a_kernel_with_the_release_stub_left_in_is_named_unfinished():
    from autograder.engine import kernels

    scaffold = ("import triton\n@triton.jit\ndef k(x_ptr, N):\n    for i in range(N):\n"
                "        # YOUR CODE HERE\n        raise NotImplementedError()\n")
    with pytest.raises(kernels.KernelRejected, match="k is not finished: it still raises NotImplementedError"):
        kernels.extract([scaffold], ("k",))
    # Only the kernels an item needs are judged: an optional one left as released is no obstacle.
    finished = "@triton.jit\ndef j(x_ptr):\n    pass\n"
    assert "def j" in kernels.extract([scaffold, finished], ("j",))


def test_missing_and_unparsable_cells_are_named():
    with pytest.raises(ArtefactRejected, match="no class, function or constant named Scaler"):
        artefacts.extract(["def other():\n    pass\n"], ("Scaler",))
    # A computed value is not a constant: it is dropped, so it cannot satisfy the item.
    with pytest.raises(ArtefactRejected, match="constant named SOURCE"):
        artefacts.extract(["SOURCE = open('/etc/passwd').read()\n"], ("SOURCE",))


def test_required_literal_constants_are_artefacts():
    kept = artefacts.extract(['SOURCE = r"""int f() { return 1; }"""\nA, B = 1, 2\nX: int = 3\n'],
                             ("SOURCE", "B", "X"))
    ns = {}
    exec(kept, ns)
    assert (ns["SOURCE"], ns["B"], ns["X"]) == ("int f() { return 1; }", 2, 3)
    with pytest.raises(ArtefactRejected, match="does not parse"):
        artefacts.extract(["def f(:\n"], ("f",))


def test_a_source_to_build_is_read_as_a_literal_without_running_the_cell():
    cells = ['import os\nos.system("never run")\nCPP = "int a;"\n', 'CPP = r"""int b;"""\ndef f():\n    return 1\n']
    assert artefacts.string_constant(cells, "CPP") == "int b;"  # the last binding, as running would leave it
    with pytest.raises(ArtefactRejected, match="no string literal to CPP"):
        artefacts.string_constant(['CPP = "int a;"\nCPP = HEADER + "int b;"\n'], "CPP")
    with pytest.raises(ArtefactRejected, match="no string literal to CPP"):
        artefacts.string_constant(["CPP = 3\n"], "CPP")
    with pytest.raises(ArtefactRejected, match="does not parse"):
        artefacts.string_constant(["CPP = '\n"], "CPP")


def test_safe_builtins_run_classes_and_refuse_the_rest():
    ns = {"__name__": "student_kernels", "torch": __import__("torch")}
    ns["__builtins__"] = reach.extracted_builtins(frozenset())
    module = _module(HONEST, ("Scaler", "Optimizer"))
    exec(compile(module.replace("torch.no_grad()", "torch.no_grad()"), "artefacts.py", "exec"), ns)
    scaler = ns["Scaler"](init_scale=8.0)
    assert scaler.get_scale() == 8.0
    opt = ns["Optimizer"]([__import__("torch").zeros(2, requires_grad=True)], lr=0.1)
    assert opt.defaults["lr"] == 0.1
    exec(compile("def sneaky():\n    return open('/etc/passwd')\n", "x.py", "exec"), ns)
    with pytest.raises(NameError, match="open"):
        ns["sneaky"]()
    # Present for C code that imports under a student frame; the screen refuses the name itself.
    assert "__import__" in SAFE_BUILTINS
    with pytest.raises(ArtefactRejected, match="__import__"):
        artefacts.extract(["def f():\n    return __import__\n"], ("f",))


def test_every_attribute_read_goes_through_the_guard_and_modules_must_be_provided():
    import torch

    from fastdl_lab import distributed

    module = artefacts.extract(["def f(x):\n    return torch.nn.functional.relu(x).sum()\n\n"
                                "def helpers():\n    return distributed.fsdp\n\n"
                                "def reach(x):\n    return torch.serialization.io\n"], ("f",))
    assert "torch.nn." not in module and f"{reach.GUARD}({reach.GUARD}(torch, 'nn'), 'functional')" in module

    def run(scope_modules: frozenset) -> dict:
        ns = {"__name__": "student_artefacts", "torch": torch, "distributed": distributed,
              "__builtins__": reach.extracted_builtins(scope_modules)}
        exec(compile(module, "artefacts.py", "exec"), ns)
        return ns

    provided = run(frozenset({"fastdl_lab.distributed", "fastdl_lab.distributed.fsdp"}))
    assert provided["f"](torch.tensor([-1.0, 2.0])).item() == 2.0
    assert provided["helpers"]() is distributed.fsdp
    with pytest.raises(reach.Unreachable, match="torch.serialization"):
        provided["reach"](None)
    with pytest.raises(reach.Unreachable, match="fastdl_lab.distributed.fsdp"):
        run(frozenset({"fastdl_lab.distributed"}))["helpers"]()


def test_the_guard_refuses_readers_by_name_and_the_interpreters_objects_at_run_time():
    import types

    guard = reach.attribute_guard(frozenset())
    for obj, name in (("{0.__class__}", "format"), ("x", "format_map"), (object(), "__class__")):
        with pytest.raises(reach.Unreachable):
            guard(obj, name)

    def gen():
        yield 1

    frame_owner = types.SimpleNamespace(frame=gen().gi_frame, code=gen.__code__)
    for name in ("frame", "code"):
        with pytest.raises(reach.Unreachable, match="interpreter"):
            guard(frame_owner, name)
    assert guard(type("T", (), {}), "__name__") == "T"


_UNPICKLING = r"""
import io, pickle, collections
import torch
from autograder.engine import reach
buffer = io.BytesIO()
torch.save({"t": torch.arange(3), "d": collections.OrderedDict(a=1)}, buffer)
reach.refuse_unpickling(r"^amp$|scaler|adam")
assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)["t"].tolist() == [0, 1, 2]
for payload in (b"cbuiltins\nexec\n.", b"cos\nsystem\n.", b"ctorch.amp\nGradScaler\n.", b"cio\nBytesIO\n."):
    try:
        pickle.loads(payload)
    except reach.Unreachable as exc:
        print("refused:", exc)
"""


def test_unpickling_what_runs_code_or_is_the_library_is_refused():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _UNPICKLING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert [line.split()[2] for line in refused] == ["builtins.exec", "os.system", "torch.amp.GradScaler", "io.BytesIO"]
