"""Lab 07 distributed: FSDP (ZeRO-3) units and the census that measures them from the rank's side."""

import functools
import gc

import pytest
import torch
import torch.distributed as dist

from fastdl_lab import checks
from fastdl_lab.distributed import census, ddp, fsdp, run_world

pytestmark = pytest.mark.distributed

DIMS = [11, 24, 30, 19, 4]
MODEL = functools.partial(fsdp.unit_mlp, 4, DIMS)
DATA = ddp.make_regression(4, 24, DIMS[0], DIMS[-1])
STEPS, LR = 3, 0.1


@pytest.fixture(scope="module")
def reference():
    return fsdp.train_reference(MODEL, DATA, STEPS, LR)


def _train(world_size, **kwargs):
    return run_world(fsdp.train_fsdp, world_size, MODEL, DATA, STEPS, LR, **kwargs)


def _problems(results, reference, dtype=None):
    return fsdp.memory_problems(results, reference) + fsdp.wire_problems(results, reference, STEPS, dtype)


class _KeepsFlatVector(fsdp.FSDPUnit):
    """Keeps the unpadded full weights it sharded: parity holds, memory does not."""

    def __init__(self, module, compute_dtype=None):
        kept = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        super().__init__(module, compute_dtype)
        self.kept = kept


class _KeepsGatheredUntilBackward(fsdp.FSDPUnit):
    """Gathers once per step and keeps every unit's weights from forward to backward (ZeRO-2 memory)."""

    def forward(self, x):
        full = fsdp._GatherParams.apply(self.shard, self)
        self.use_views(full)
        return self.module(fsdp.cast_floating(x, self.compute_dtype))

    def gather(self, async_op=False):
        if self.full.untyped_storage().nbytes() == 0:
            super().gather()


class _DropsReferences(fsdp.FSDPUnit):
    """"Frees" by gathering into a new buffer each time: the old ones live on in the layers' views."""

    def gather(self, async_op=False):
        self.full = torch.empty(self.full.shape, dtype=self.full.dtype)
        super().gather()

    def free(self):
        fsdp.register_sharded(self.slots, self.params)  # the layers back on their shards; no storage freed


class _RegistersCopies(fsdp.FSDPUnit):
    """The parameters under their own names, but copies of their pieces of the shard, written back
    into it before each gather: parity holds, the weights are held twice."""

    def __init__(self, module, compute_dtype=None):
        super().__init__(module, compute_dtype)
        self.params = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        fsdp.register_sharded(self.slots, self.params)

    def gather(self, async_op=False):
        if self._pending is None:
            with torch.no_grad():
                for slot, param in zip(self.slots, self.params):
                    lo = min(max(slot.offset - self.start, 0), self.shard_size)
                    self.shard[lo:lo + param.numel()] = param.reshape(-1)
        super().gather(async_op)


def test_flat_layout_pads_to_equal_shards():
    block = MODEL()[0]
    slots, numel, shard = fsdp.flat_layout(block, 3)
    assert [([(o is block[0], n) for o, n in slot.owners], tuple(slot.shape), slot.offset) for slot in slots] == [
        ([(True, "weight")], (24, 11), 0), ([(True, "bias")], (24,), 24 * 11)]
    assert numel == 24 * 11 + 24 and shard == -(-numel // 3)
    flat = fsdp.flatten_padded(list(block.parameters()), 3 * shard)
    assert flat.shape == (3 * shard,) and flat[numel:].eq(0).all()
    with pytest.raises(ValueError, match="at least one parameter"):
        fsdp.flat_layout(torch.nn.Tanh(), 2)


def test_a_tied_weight_is_one_slot_with_both_owners():
    block = fsdp.TiedEmbeddingBlock(7, 5)
    slots, numel, _ = fsdp.flat_layout(block, 2)
    assert [sorted(name for _, name in slot.owners) for slot in slots] == [["weight", "weight"], ["bias"]]
    assert numel == 7 * 5 + 7
    with pytest.raises(ValueError, match="tied weights must be in one unit"):
        shared = torch.nn.Linear(3, 3)
        fsdp.check_no_ties_across([torch.nn.Sequential(shared), torch.nn.Sequential(shared)])


def test_parameters_move_only_through_the_slots_of_modules():
    block = MODEL()[0]
    slots, numel, _ = fsdp.flat_layout(block, 2)
    fsdp.drop_parameters(slots)
    assert list(block.parameters()) == []
    full = torch.arange(float(numel + 1))
    fsdp.place_views(slots, full)
    assert block[0].weight.data_ptr() == full.data_ptr() and block[0].bias[0].item() == 24 * 11
    with pytest.raises(ValueError, match="no parameter 'weight'"):
        fsdp.drop_parameters(slots)
    # Sharded parameters are views of the shard, registered under the layers' own names.
    shard = torch.arange(float(numel // 2 + 1))
    params = fsdp.sharded_parameters(slots, shard, 0)
    fsdp.register_sharded(slots, params)
    assert [name for name, _ in block.named_parameters()] == ["0.weight", "0.bias"]
    assert block[0].weight.data_ptr() == shard.data_ptr() and block[0].bias.numel() == 0
    # The helpers are what graded code may call: they set layers' public attributes, nothing else.
    with pytest.raises(TypeError, match="a slot is"):
        fsdp.place_views([(torch.Tensor, "grad", torch.Size([1]))], full)
    with pytest.raises(TypeError, match="owners are"):
        fsdp.place_views([fsdp.Slot(((block[0], "_parameters"),), torch.Size([1]), 0)], full)


def test_only_floating_inputs_are_cast_and_none_without_a_dtype():
    ids, x = torch.tensor([[1, 2]]), torch.ones(2)
    assert fsdp.cast_floating(ids, torch.bfloat16).dtype == torch.int64
    assert fsdp.cast_floating((x, {"ids": ids}), torch.bfloat16)[0].dtype == torch.bfloat16
    assert fsdp.cast_floating(x.double(), None).dtype == torch.float64


@pytest.mark.parametrize("world_size, prefetch", [(2, False), (3, True)])
def test_fsdp_matches_one_process_and_keeps_one_shard(reference, world_size, prefetch):
    results = _train(world_size, prefetch=prefetch)
    fsdp.check_parity(results, reference)
    assert _problems(results, reference) == []
    shards = 4 * sum(shard for _, shard in fsdp.unit_sizes(reference, world_size))
    for result in results:
        assert result["memory"]["param_bytes"] == result["memory"]["grad_bytes"] == shards
        assert result["memory"]["resident_bytes"] == 2 * shards  # shards and their gradients, nothing more
        assert result["wire"]["max_live_buffers"] == (1 if prefetch else 0)


def test_fsdp_in_bf16_keeps_fp32_masters_and_gathers_half_the_bytes(reference):
    lowp = fsdp.train_reference(MODEL, DATA, STEPS, LR, compute_dtype=torch.bfloat16, world_size=2)
    results = _train(2, compute_dtype=torch.bfloat16)
    fsdp.check_parity(results, reference, lowp_reference=lowp)
    assert _problems(results, reference, torch.bfloat16) == []
    fp32_problems = fsdp.wire_problems(results, reference, STEPS)
    assert fp32_problems and "all-gathers produced" in fp32_problems[0]
    # The rule has teeth: the bf16 run itself is far from fp32 parity.
    with pytest.raises(checks.MismatchError):
        fsdp.check_parity(results, reference)


@pytest.mark.parametrize("unit_cls, where, words", [
    (_KeepsFlatVector, "memory", "still holds"),
    (_KeepsGatheredUntilBackward, "wire", "all-gathers"),
    (_DropsReferences, "memory", "still holds"),
    (_RegistersCopies, "memory", "not views of their unit's shard"),
])
def test_fsdp_mistakes_keep_parity_but_are_measured(reference, unit_cls, where, words):
    results = _train(2, unit_cls=unit_cls)
    fsdp.check_parity(results, reference)
    problems = (fsdp.memory_problems if where == "memory" else
                functools.partial(fsdp.wire_problems, steps=STEPS))(results, reference)
    assert problems and words in problems[0]


def test_unsharded_or_renamed_parameters_fail_parity(reference):
    whole = [{"params": {n: p.detach().reshape(-1) for n, p in MODEL().named_parameters()}} for _ in range(2)]
    with pytest.raises(checks.MismatchError, match="pieces hold"):
        fsdp.check_parity(whole, reference)
    # One flat parameter per unit, as a unit that kept only its shard would list it.
    flat = [{"params": {f"{u}.shard": torch.zeros(10) for u in range(4)}} for _ in range(2)]
    with pytest.raises(checks.MismatchError, match="named .*own names"):
        fsdp.check_parity(flat, reference)


LM = functools.partial(fsdp.unit_lm, 5, 23, 10, 14, 3)
LM_DATA = fsdp.make_token_data(5, 12, 6, 23, 3)


@pytest.mark.parametrize("world_size, dtype", [(3, None), (2, torch.bfloat16)])
def test_a_tied_embedding_fed_token_ids_trains_under_its_own_names(world_size, dtype):
    reference = fsdp.train_reference(LM, LM_DATA, STEPS, LR)
    results = run_world(fsdp.train_fsdp, world_size, LM, LM_DATA, STEPS, LR, compute_dtype=dtype)
    lowp = fsdp.train_reference(LM, LM_DATA, STEPS, LR, compute_dtype=dtype, world_size=world_size) if dtype else None
    fsdp.check_parity(results, reference, lowp_reference=lowp)
    assert fsdp.memory_problems(results, reference) + fsdp.wire_problems(results, reference, STEPS, dtype) == []
    assert list(results[0]["params"]) == [name for name, _ in reference.named_parameters()]
    assert "0.project.weight" not in results[0]["params"]  # the tie holds: one matrix, listed once


TIED = (("embed", "weight"), ("project", "weight"), ("project", "bias"))


def _registrations_trial(rank, world_size):
    """What the layers of a tied unit hold before, while and after it computes, forward and
    backward: each attribute's shape, whether it is a registered parameter, whether it lives in
    the shard; and the parameters' names and gradients after the backward."""
    unit = fsdp.FSDPUnit(LM()[0])
    block, seen = unit.module, {}

    def record(when):
        seen[when] = {f"{owner}.{name}": (tuple(getattr(getattr(block, owner), name).shape),
                                          name in getattr(block, owner)._parameters,
                                          census.shares_storage(getattr(getattr(block, owner), name), unit.shard))
                      for owner, name in TIED}
        seen[when]["tied"] = block.embed.weight is block.project.weight

    record("before")
    block.register_forward_pre_hook(lambda *_: record("forward"))
    out = unit(LM_DATA[0][:4])
    record("after forward")
    out.register_hook(lambda _: record("backward"))  # after the unit's own hook, which gathers again
    out.square().sum().backward()
    record("after backward")
    return {"seen": seen, "start": unit.start, "shard_size": unit.shard_size,
            "grads": {fsdp.clean_name(n): p.grad.clone() for n, p in unit.named_parameters()}}


def test_layers_hold_full_views_while_computing_and_views_of_the_shard_otherwise():
    block = LM()[0]
    vocab, width = block.embed.weight.shape
    numel = vocab * width + vocab
    block(LM_DATA[0][:4]).square().sum().backward()
    results = run_world(_registrations_trial, 2)
    full = {"weight": (vocab, width), "bias": (vocab,)}
    for rank, result in enumerate(results):
        seen = result["seen"]
        lo, hi = result["start"], result["start"] + result["shard_size"]
        piece = {"weight": (0, vocab * width), "bias": (vocab * width, numel)}
        sharded = {k: (max(0, min(b, hi) - max(a, lo)),) for k, (a, b) in piece.items()}
        for when in seen:
            assert seen[when]["tied"], (rank, when)  # both owners hold one tensor, always
            got = {k: v for k, v in seen[when].items() if k != "tied"}
            computing = when in ("forward", "backward")
            # Computing: plain views of the gathered vector, full shape. Otherwise: registered
            # parameters, 1-D views of the shard.
            want = {f"{o}.{n}": (full[n], False, False) if computing else (sharded[n], True, True) for o, n in TIED}
            assert got == want, (rank, when)
        assert list(result["grads"]) == ["embed.weight", "project.bias"]
    assert sum(r["seen"]["before"]["embed.weight"][0][0] for r in results) == vocab * width
    assert 0 in [r["seen"]["before"]["project.bias"][0][0] for r in results]  # one rank holds none of it
    # Every rank trained on the same rows, so the averaged gradient is the one-process gradient,
    # the tied matrix's two uses summed; each rank's .grad is its piece of it.
    for name, p in block.named_parameters():
        got = torch.cat([r["grads"][name] for r in results]).view_as(p)
        checks.assert_close(got, p.grad, atol=1e-5, rtol=1e-4, name=name)


class _CastsEverything(fsdp.FSDPUnit):
    """Casts every input to the compute dtype, token ids included."""

    def forward(self, x):
        return super().forward(x.to(self.compute_dtype or torch.float32))


def test_casting_token_ids_fails_where_they_index_an_embedding():
    with pytest.raises(Exception, match="Long|Int|indices|index"):
        run_world(fsdp.train_fsdp, 2, LM, LM_DATA, 1, LR, unit_cls=_CastsEverything, compute_dtype=torch.bfloat16)


def _census_trial(rank, world_size):
    ahead = torch.zeros(4096)  # set aside before the snapshot, filled after it
    untouched = torch.ones(1024)
    swapped = torch.ones(8)  # an old tensor given a new storage of 512 floats
    # Meta tensors have a size but no bytes (a model built on the meta device): none are counted.
    shapes_only = torch.empty(1 << 20, device="meta")
    with census.snapshot() as before:
        ahead += 1
        swapped.set_(torch.zeros(512).untyped_storage())
        fresh = torch.zeros(256)
        more_shapes = torch.empty(1 << 18, device="meta")
        frozen = gc.get_freeze_count() > 0
        counted = census.resident_bytes(before)
        excluded = census.resident_bytes(before, exclude=[fresh])
    thawed = gc.get_freeze_count() == 0
    with census.sharded_collectives() as wire:
        out = torch.empty(2 * world_size)
        dist.all_gather_single(out, torch.ones(2))
        dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * world_size))
        try:
            dist.all_reduce(torch.ones(1))
            refused = ""
        except census.CollectiveRefused as exc:
            refused = str(exc)
    del untouched, shapes_only, more_shapes
    return {"counted": counted, "excluded": excluded, "wire": wire.summary(), "refused": refused,
            "frozen": frozen, "thawed": thawed}


def test_census_counts_new_and_changed_storages_and_refuses_other_collectives():
    result = run_world(_census_trial, 2)[0]
    assert result["counted"] - result["excluded"] == 256 * 4
    # The filled buffer, the swapped storage and the new one; not the untouched buffer.
    assert result["counted"] == (4096 + 512 + 256) * 4
    assert result["frozen"] and result["thawed"]
    assert result["wire"]["all_gathers"] == 1 and result["wire"]["gathered_bytes"] == 2 * 2 * 4
    assert result["wire"]["reduce_scatters"] == 1 and result["wire"]["reduced_bytes"] == 2 * 2 * 4
    assert "allreduce" in result["refused"]


def test_an_older_torch_gets_the_collective_names_the_lab_teaches(monkeypatch):
    from fastdl_lab import distributed

    assert callable(dist.all_gather_single) and callable(dist.reduce_scatter_single)
    # torch 2.11 has only all_gather_into_tensor and reduce_scatter_tensor.
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name)
    distributed._name_collectives_as_newer_torch()
    assert dist.all_gather_single is dist.all_gather_into_tensor
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
