"""Lab 04 mixed precision: AdamW as a loop, as foreach ops and as one fused Triton kernel, against torch."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

from fastdl_lab import checks, optim

DEV = "cuda" if device.has_gpu() else "cpu"
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
# One element, ragged lengths, 2-D and 3-D, and a tensor of several 256-element chunks plus a remainder.
RAGGED = [(1,), (37,), (5, 7), (300,), (3, 4, 5), (1030,)]
MANY = [((7 * i) % 61 + 1,) for i in range(100)]
# Large blocks keep the number of interpreted programs, hence the run time, small.
BLOCK = 256


def _fused(*args, **kwargs):
    return optim.fused_adamw(*args, **kwargs, block=BLOCK)


IMPLS = {"loop": optim.adamw_ref, "foreach": optim.adamw_foreach, "fused": _fused}
IMPL_PARAMS = ["loop", "foreach", pytest.param("fused", marks=pytest.mark.interpret)]


def _grads(shapes, step, dtype=torch.float32):
    return [checks.randn(s, dtype=dtype, seed=1000 * step + i, device=DEV) for i, s in enumerate(shapes)]


def _torch_adamw(shapes, steps, dtype=torch.float32):
    """torch.optim.AdamW(foreach=False) on fp32 copies of the 16-bit start values and gradients."""
    params = [checks.randn(s, dtype=dtype, seed=i, device=DEV).float() for i, s in enumerate(shapes)]
    opt = torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    for step in range(1, steps + 1):
        for p, g in zip(params, _grads(shapes, step, dtype)):
            p.grad = g.float()
        opt.step()
    return {"param": params, "exp_avg": [opt.state[p]["exp_avg"] for p in params],
            "exp_avg_sq": [opt.state[p]["exp_avg_sq"] for p in params]}


def _ours(impl, shapes, steps, dtype=torch.float32, master=False):
    params = [checks.randn(s, dtype=dtype, seed=i, device=DEV) for i, s in enumerate(shapes)]
    state = {"param": params, "exp_avg": [torch.zeros(s, device=DEV) for s in shapes],
             "exp_avg_sq": [torch.zeros(s, device=DEV) for s in shapes],
             "master": [p.float() for p in params] if master else None}
    launches = [IMPLS[impl](params, _grads(shapes, step, dtype), state["exp_avg"], state["exp_avg_sq"], step,
                            masters=state["master"], **HYPER) for step in range(1, steps + 1)]
    return state, launches


def _assert_all_close(actual, expected, name, **tol):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        checks.assert_close(a, e, name=f"{name} {i}", **tol)


def _ulps(a, b):
    """Largest distance between a and b in units in the last place of their (16-bit) dtype."""
    unit = (torch.nextafter(b.abs(), torch.full_like(b, float("inf"))) - b.abs()).float()
    return float(((a.float() - b.float()).abs() / unit).max()) if a.numel() else 0.0


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_fp32_matches_torch_over_20_steps(impl):
    ours, launches = _ours(impl, RAGGED, 20)
    theirs = _torch_adamw(RAGGED, 20)
    for name in theirs:
        # The loop IS torch's single-tensor math, so it must agree to the bit; the kernel computes
        # its bias corrections in fp32 rather than float64 and may differ by a few rounding units.
        exact = {"atol": 0, "rtol": 0} if impl == "loop" else {}
        _assert_all_close(ours[name], theirs[name], f"{impl} {name}", **exact)
    assert launches == ([1] * 20 if impl == "fused" else [None] * 20)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_many_small_tensors_match_torch(impl):
    ours, _ = _ours(impl, MANY, 3)
    theirs = _torch_adamw(MANY, 3)
    for name in theirs:
        _assert_all_close(ours[name], theirs[name], f"{impl} {name}")


@pytest.mark.interpret
def test_views_off_a_16_byte_boundary_match_torch():
    # Parameters and gradients as views of flat buffers, starting one element in: their addresses
    # are 4 bytes past a 16-byte boundary, so the table says so and the kernel takes no vector path.
    starts = [1 + sum(torch.Size(s).numel() for s in RAGGED[:i]) for i in range(len(RAGGED))]

    def views(tensors):
        flat = torch.zeros(1 + sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=DEV)
        out = [flat[a:a + t.numel()].view(t.shape) for a, t in zip(starts, tensors)]
        for o, t in zip(out, tensors):
            o.copy_(t)
        return out

    params = views([checks.randn(s, seed=i, device=DEV) for i, s in enumerate(RAGGED)])
    moments = [[torch.zeros(s, device=DEV) for s in RAGGED] for _ in range(2)]
    assert not optim.multi_tensor_table([params, params, *moments], BLOCK).aligned
    for step in range(1, 4):
        assert _fused(params, views(_grads(RAGGED, step)), *moments, step, **HYPER) == 1
    theirs = _torch_adamw(RAGGED, 3)
    _assert_all_close(params, theirs["param"], "param")
    _assert_all_close(moments[1], theirs["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.interpret
def test_one_launch_per_step_whatever_the_number_of_tensors():
    for n in (10, 100):
        _, launches = _ours("fused", MANY[:n], 2)
        assert launches == [1, 1], n


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_follow_fp32_adamw(impl, dtype):
    ours, _ = _ours(impl, RAGGED, 20, dtype, master=True)
    theirs = _torch_adamw(RAGGED, 20, dtype)
    _assert_all_close(ours["master"], theirs["param"], f"{impl} master")
    _assert_all_close(ours["exp_avg"], theirs["exp_avg"], f"{impl} exp_avg")
    # The interpreter's fp32 -> bf16 cast truncates where a GPU (and torch) rounds to nearest, so
    # a third of the elements come out one unit below the rounded master there. Its fp16 casts
    # round like torch's: exact.
    allowed = 1 if dtype == torch.bfloat16 and impl == "fused" and device.interpreting() else 0
    for i, (p, w) in enumerate(zip(ours["param"], ours["master"])):
        assert p.dtype == dtype
        assert _ulps(p, w.to(dtype)) <= allowed, (impl, i)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_without_master_agree(dtype):
    # Compared one step at a time from a shared state: chained, a one-unit difference is fed back
    # into the next step's 16-bit param, and the interpreter's truncating bf16 cast drifts a whole
    # unit towards zero per step where rounding keeps the param (20 units after 20 steps). One unit
    # (eps relative) for a rounding that went the other way, and 1e-6 absolute for the kernel's fp32
    # bias corrections (torch's are float64), visible where a param is a tiny difference.
    params = [checks.randn(s, dtype=dtype, seed=i, device=DEV) for i, s in enumerate(RAGGED)]
    moments = [[torch.zeros(s, device=DEV) for s in RAGGED] for _ in range(2)]
    for step in range(1, 21):
        grads = _grads(RAGGED, step, dtype)
        results = {}
        for impl in ("foreach", "fused", "loop"):
            state = [[t.clone() for t in ts] for ts in (params, *moments)] if impl != "loop" else [params, *moments]
            IMPLS[impl](*state[:1], grads, *state[1:], step, **HYPER)
            results[impl] = state
        for impl in ("foreach", "fused"):
            for i, (a, e) in enumerate(zip(results[impl][0], params)):
                checks.assert_close(a.float(), e.float(), atol=1e-6, rtol=torch.finfo(dtype).eps,
                                    name=f"{impl} param {i} step {step}")
            _assert_all_close(results[impl][1], moments[0], f"{impl} exp_avg step {step}")
            _assert_all_close(results[impl][2], moments[1], f"{impl} exp_avg_sq step {step}")


@pytest.mark.interpret
def test_mixed_dtypes_take_one_launch_each():
    shapes = [(3, 5), (40,), (300,), (7,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    results = {}
    for impl in ("loop", "fused"):
        params = [checks.randn(s, dtype=d, seed=i, device=DEV) for i, (s, d) in enumerate(zip(shapes, dtypes))]
        grads = [checks.randn(s, dtype=d, seed=9 + i, device=DEV) for i, (s, d) in enumerate(zip(shapes, dtypes))]
        moments = [[torch.zeros(s, device=DEV) for s in shapes] for _ in range(2)]
        masters = [None if p.dtype == torch.float32 else p.float() for p in params]
        results[impl] = IMPLS[impl](params, grads, *moments, 1, masters=masters, **HYPER), params, moments, masters
    assert results["fused"][0] == 2
    _assert_all_close(results["fused"][1][::2], results["loop"][1][::2], "fp32 param")
    _assert_all_close(results["fused"][3][1::2], results["loop"][3][1::2], "bf16 master")
    _assert_all_close(results["fused"][2][0], results["loop"][2][0], "exp_avg")


@pytest.mark.interpret
def test_nothing_to_update_launches_nothing():
    assert optim.fused_adamw([], [], [], [], 1, **HYPER) == 0
    empty = [torch.zeros(0, device=DEV)]
    assert optim.fused_adamw(empty, empty, empty, empty, 1, **HYPER) == 0


@pytest.mark.interpret
def test_launcher_passes_the_tables_to_the_given_kernel():
    """What a student's kernel receives: the grid, the tables, and the param table standing in for masters."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, args, kwargs))
                optim._fused_adamw_kernel[grid](*args, **kwargs)
            return launch

    params = [checks.randn(s, seed=i, device=DEV) for i, s in enumerate(RAGGED)]
    moments = [[torch.zeros(s, device=DEV) for s in RAGGED] for _ in range(2)]
    assert optim.fused_adamw(params, _grads(RAGGED, 1), *moments, 1, kernel=Recorder(), block=BLOCK, **HYPER) == 1
    (grid, args, kwargs), = launches
    assert grid == (sum(-(-p.numel() // BLOCK) for p in params),)
    assert args[0].tolist() == [p.data_ptr() for p in params] == args[4].tolist()
    config = optim.default_config(None)
    assert args[8] == 1 and kwargs == {"PARAM_DTYPE": optim.tl.float32, "HAS_MASTER": False, "BLOCK": BLOCK,
                                       "num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    reference = _ours("loop", RAGGED, 1)[0]
    _assert_all_close(params, reference["param"], "param")


def _lists(n=2, dtype=torch.float32):
    return [[torch.zeros(4, dtype=dtype, device=DEV) for _ in range(n)] for _ in range(4)]


@pytest.mark.parametrize("mutate, kwargs, error, message", [
    (lambda l: l[0].append(torch.zeros(4, device=DEV)), {}, ValueError, "one entry per parameter"),
    (lambda l: l[0].__setitem__(0, torch.zeros(4, 2, device=DEV).t()), {}, ValueError, "contiguous"),
    (lambda l: l[2].__setitem__(1, torch.zeros(4, dtype=torch.float16, device=DEV)), {}, TypeError, "float32"),
    (lambda l: l[1].__setitem__(0, torch.zeros(4, dtype=torch.float16, device=DEV)), {}, TypeError, "dtype"),
    (lambda l: l[3].__setitem__(0, torch.zeros(5, device=DEV)), {}, ValueError, "elements"),
    (lambda l: l[1].__setitem__(0, [0.0] * 4), {}, TypeError, "torch.Tensor"),
    (lambda l: l[0].__setitem__(0, torch.zeros(4, device="meta")), {}, ValueError, "meta"),
    (lambda l: None, {"block": 100}, ValueError, "power of two"),
    (lambda l: None, {"step": 0}, ValueError, "step counts from 1"),
    (lambda l: None, {"masters": [torch.zeros(4, dtype=torch.float16, device=DEV)] * 2}, TypeError, "float32"),
])
def test_fused_validates_its_inputs(mutate, kwargs, error, message):
    lists = _lists()
    mutate(lists)
    args = {"step": 1, **HYPER, **kwargs}
    with pytest.raises(error, match=message):
        optim.fused_adamw(*lists, args.pop("step"), **args)


def test_integer_params_are_refused():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        optim.fused_adamw(*_lists(dtype=torch.int32)[:2], *_lists()[2:], 1, **HYPER)


def test_multi_tensor_table_chunks_ragged_tensors():
    sizes = [1, 4, 5, 0, 9]
    a = [torch.zeros(n, device=DEV) for n in sizes]
    b = [torch.ones(n, dtype=torch.float16, device=DEV) for n in sizes]
    table = optim.multi_tensor_table([a, b], 4)
    assert [t.tolist() for t in table.addrs] == [[t.data_ptr() for t in a], [t.data_ptr() for t in b]]
    assert table.numels.tolist() == sizes
    # Chunks start at 0, 4, 8... of each tensor; the empty tensor has none.
    assert table.chunk_tensor.tolist() == [0, 1, 2, 2, 4, 4, 4]
    assert table.chunk_start.tolist() == [0, 0, 0, 4, 0, 4, 8]
    assert table.n_chunks == 7
    for t in (*table.addrs, table.numels, table.chunk_tensor, table.chunk_start):
        assert t.dtype == torch.int64 and t.device.type == DEV


def test_a_table_says_whether_every_address_is_16_byte_aligned():
    whole = [torch.zeros(n, device=DEV) for n in (3, 9)]
    assert whole[0].data_ptr() % 16 == whole[1].data_ptr() % 16 == 0
    assert optim.multi_tensor_table([whole, whole], 4).aligned
    assert not optim.multi_tensor_table([whole, [whole[0], whole[1][1:4]]], 4).aligned


def test_a_table_is_reused_for_the_same_tensors_and_rebuilt_for_others():
    a = [torch.zeros(n, device=DEV) for n in (3, 9)]
    table = optim.multi_tensor_table([a, a], 4)
    assert optim.multi_tensor_table([a, a], 4) is table
    assert optim.multi_tensor_table([a, a], 8) is not table
    b = [torch.zeros(n, device=DEV) for n in (3, 9)]
    other = optim.multi_tensor_table([b, b], 4)
    assert other is not table and other.addrs[0].tolist() == [t.data_ptr() for t in b]
    assert other.chunk_start.tolist() == [0, 0, 4, 8]


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_multi_tensor_table_costs_a_fixed_number_of_torch_ops():
    counts = {}
    for n in (10, 100):
        tensors = [torch.zeros(i % 9 + 1, device=DEV) for i in range(n)]
        with _CountOps() as mode:
            optim.multi_tensor_table([tensors, tensors, tensors], 4)
        counts[n] = len(mode.ops)
    assert counts[10] == counts[100] > 0, counts
    # The NumPy buffer taken as a tensor (lift_fresh) and its split; on a GPU also pin_memory(),
    # which is two ops (is_pinned, then _pin_memory), and the copy to the device (_to_copy): five.
    # Few enough that a build never uses up the op slack lab 04's grader allows a fused step (6):
    # whether a step finds its table built depends on where the allocator put the gradients.
    assert counts[10] <= (5 if DEV == "cuda" else 2), mode.ops


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 33), nn.LayerNorm(33), nn.ReLU(), nn.Linear(33, 5)).to(DEV, dtype)


def _train(model, opt, steps, skip=None):
    """``steps`` AdamW steps on a fixed batch; the parameter ``skip`` gets no gradient on even steps."""
    x = checks.randn(16, 7, seed=1, device=DEV, dtype=next(model.parameters()).dtype)
    y = checks.randn(16, 5, seed=2, device=DEV, dtype=x.dtype)
    losses, launches = [], []
    for step in range(steps):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
            if skip is not None and step % 2:
                skip.grad = None
            return loss
        losses.append(opt.step(closure))
        launches.append(getattr(opt, "launches", None))
    return losses, launches


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_optimizer_matches_torch_adamw(impl):
    ours, theirs = _model(), _model()
    opt = optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, impl=impl)
    losses, launches = _train(ours, opt, 20)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ref_losses, _ = _train(theirs, ref, 20)
    assert all(isinstance(loss, torch.Tensor) for loss in losses)
    checks.assert_close(torch.stack(losses), torch.stack(ref_losses).detach(), name="losses")
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        checks.assert_close(p.detach(), q.detach(), name=name)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype == ref.state[q][key].dtype == torch.float32
            checks.assert_close(opt.state[p][key], ref.state[q][key], name=f"{name} {key}")
    assert launches == ([1] * 20 if impl == "fused" else [0] * 20)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_optimizer_skips_params_without_grad(impl):
    ours, theirs = _model(), _model()
    frozen, frozen_ref = nn.Parameter(torch.ones(3, device=DEV)), nn.Parameter(torch.ones(3, device=DEV))
    opt = optim.AdamW([*ours.parameters(), frozen], lr=1e-2, impl=impl)
    ref = torch.optim.AdamW([*theirs.parameters(), frozen_ref], lr=1e-2, foreach=False)
    # The last layer's bias misses every other gradient: its step count falls behind the others'.
    _, launches = _train(ours, opt, 6, skip=ours[3].bias)
    _train(theirs, ref, 6, skip=theirs[3].bias)
    assert len(opt.state[frozen]) == len(ref.state[frozen_ref]) == 0
    assert torch.equal(frozen, torch.ones(3, device=DEV))
    assert float(opt.state[ours[3].bias]["step"]) == float(ref.state[theirs[3].bias]["step"]) == 3
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        checks.assert_close(p.detach(), q.detach(), name=name)
    if impl == "fused":
        # One launch per distinct step count: the kernel takes one step for all its tensors.
        assert launches == [1, 1, 2, 1, 2, 1]


@pytest.mark.interpret
def test_optimizer_master_weights_for_bf16():
    model = _model(dtype=torch.bfloat16)
    opt = optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    _train(model, opt, 3)
    allowed = 1 if device.interpreting() else 0  # the interpreter's bf16 cast truncates (see above)
    for p in model.parameters():
        state = opt.state[p]
        assert p.dtype == torch.bfloat16
        assert state["master"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert _ulps(p.detach(), state["master"].to(torch.bfloat16)) <= allowed
    # fp32 parameters need no master.
    model = _model()
    opt = optim.AdamW(model.parameters(), master_weights=True)
    _train(model, opt, 1)
    assert all("master" not in opt.state[p] for p in model.parameters())


@pytest.mark.interpret
def test_state_dict_round_trip_keeps_fp32_state():
    # torch's load_state_dict casts floating state to each param's dtype: bf16 moments and masters
    # would lose what the master is there to keep.
    model, twin = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    opt = optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    _train(model, opt, 2)
    twin.load_state_dict(model.state_dict())
    restored = optim.AdamW(twin.parameters(), lr=1e-2, master_weights=True)
    # As from a checkpoint: torch's loader keeps the saved "step" tensors themselves, which a later
    # step of ``opt`` would advance.
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert restored.state[q][key].dtype == torch.float32
            assert torch.equal(restored.state[q][key], opt.state[p][key])
        assert not checks.shares_memory(restored.state[q]["master"], opt.state[p]["master"])
    _train(model, opt, 2)
    _train(twin, restored, 2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], restored.state[q]["master"])


def test_closure_loss_is_returned():
    model = _model()
    opt = optim.AdamW(model.parameters(), impl="loop")
    assert opt.step() is None
    sentinel = torch.tensor(3.0)
    assert opt.step(lambda: sentinel) is sentinel


def _message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("kwargs", [{"lr": -1.0}, {"eps": -1e-8}, {"betas": (1.0, 0.999)}, {"betas": (0.9, -0.1)},
                                    {"weight_decay": -0.1}])
def test_bad_hyperparameters_raise_like_torch(kwargs):
    params = list(_model().parameters())
    assert _message(lambda: optim.AdamW(params, **kwargs)) == _message(lambda: torch.optim.AdamW(params, **kwargs))


@pytest.mark.parametrize("kwargs, message", [({"amsgrad": True}, "amsgrad"), ({"maximize": True}, "maximize"),
                                             ({"impl": "cuda"}, "impl")])
def test_unsupported_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        optim.AdamW(_model().parameters(), **kwargs)


def test_empty_parameter_list_raises_torchs_error():
    assert _message(lambda: optim.AdamW([])) == _message(lambda: torch.optim.AdamW([]))


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_mixed_devices_are_refused(impl):
    here, elsewhere = nn.Parameter(torch.zeros(3, device=DEV)), nn.Parameter(torch.zeros(3, device="meta"))
    here.grad, elsewhere.grad = torch.ones_like(here), torch.ones_like(elsewhere)
    with pytest.raises(ValueError, match=f"several devices.*{DEV}.*meta"):
        optim.AdamW([here, elsewhere], impl=impl).step()


def test_sparse_gradients_are_refused():
    p = nn.Parameter(torch.zeros(4, 3, device=DEV))
    p.grad = torch.zeros(4, 3, device=DEV).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optim.AdamW([p], impl="loop").step()


@pytest.mark.interpret
def test_module_check_passes(capsys):
    optim.check()
    assert "checks passed" in capsys.readouterr().out


def test_bytes_per_parameter():
    # fp32: read param, grad, m, v and write param, m, v: 7 x 4 bytes. bf16 with an fp32 master: the
    # same 28 (the master replaces the param, and the bf16 param and grad add 2 + 2 bytes).
    assert optim.adamw_bytes(10, torch.float32, False) == 280
    assert optim.adamw_bytes(10, torch.bfloat16, True) == 280
    assert optim.adamw_bytes(10, torch.bfloat16, False) == 220


def test_a_float_learning_rate_recompiles_the_compiled_step_and_a_tensor_does_not():
    # The schedule changes the rate every step: a float baked into the first graph forces at
    # least one more; a tensor is an input of the one graph.
    as_float, as_tensor = optim.compiled_step_graphs(False), optim.compiled_step_graphs(True)
    assert as_float["graphs"] >= 2 and as_tensor["graphs"] == 1
    assert len(as_float["seconds"]) == len(as_tensor["seconds"]) == 6
