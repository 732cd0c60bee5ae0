"""Refuse the library's own kernels of a graded technique at torch's dispatcher, in a grading child.

An item that grades the student's version of something the library also does (a loss scaler, a
fused AdamW, an int8 quantiser) names the library's Python objects in ``Item.library``, which the
artefact screen refuses by name. The Python objects end in a few ATen ops (``GradScaler`` in
``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``; ``AdamW(fused=True)``
in ``_fused_adamw_``; ``torch.quantize_per_channel`` in its namesake), which any path to them, by
name or not, has to call. ``refusing(ops, why)``, run by an item's trusted ``scope`` before the
student's definitions exist, replaces those ops' kernels in the child (on every backend they
have: CPU, CUDA, the quantized ones, and their composite kernels) by one that raises
``LibraryRefused``. The child's drive must not need the ops itself.

The replacements are registered through ``torch.library`` and held here, out of reach of screened
code (which cannot name this module or torch's registries). Code that has escaped the screen and
reaches the holding objects could undo them; it could equally do the work by hand, which is why
the item's score rests on values the parent recomputes, and this is a second line.
"""

from __future__ import annotations

import warnings

import torch

# The dispatch keys whose kernels an op's call ends in, in this build of torch.
BACKEND_KEYS = ("CPU", "CUDA", "QuantizedCPU", "QuantizedCUDA", "CompositeExplicitAutograd",
                "CompositeImplicitAutograd")
# The registrations made: dropped, they would be undone.
_HELD: list = []

AMP_SCALER_OPS = ("_amp_foreach_non_finite_check_and_unscale_", "_amp_foreach_non_finite_check_and_unscale",
                  "_amp_update_scale_", "_amp_update_scale")
FUSED_ADAM_OPS = ("_fused_adamw_", "_fused_adamw", "_fused_adam_", "_fused_adam")
QUANTIZER_OPS = ("quantize_per_channel", "quantize_per_tensor", "quantize_per_tensor_dynamic",
                 "fake_quantize_per_channel_affine", "fake_quantize_per_tensor_affine",
                 "fake_quantize_per_channel_affine_cachemask", "fake_quantize_per_tensor_affine_cachemask",
                 "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams",
                 "_fake_quantize_learnable_per_channel_affine", "_fake_quantize_learnable_per_tensor_affine",
                 "fused_moving_avg_obs_fake_quant", "_fused_moving_avg_obs_fq_helper", "choose_qparams_optimized",
                 "_choose_qparams_per_tensor", "int_repr", "q_per_channel_scales", "q_per_channel_zero_points",
                 "q_scale", "q_zero_point", "dequantize")


class LibraryRefused(RuntimeError):
    """The submission called the library's version of what the item grades."""


def _registered() -> list[str]:
    """Every operator the dispatcher knows, overloads apart ("aten::add.Tensor")."""
    return torch._C._dispatch_get_all_op_names()


def foreach_ops() -> tuple[str, ...]:
    """Every ``_foreach_*`` op of this torch: the multi-tensor kernels torch's optimizers use."""
    return tuple(sorted({name[len("aten::"):].split(".")[0] for name in _registered()
                         if name.startswith("aten::_foreach_")}))


def _overloads(name: str, registered: list[str]) -> list[str]:
    # An op this torch does not have cannot be called either.
    return [op for op in registered if op == f"aten::{name}" or op.startswith(f"aten::{name}.")]


def refusing(ops, why: str) -> int:
    """Make every call of the ATen ops ``ops`` raise ``LibraryRefused(why)`` in this process, from
    now on; the number of kernels replaced."""
    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - a registration that only refuses

    def refuse(*_args, **_kwargs):
        raise LibraryRefused(why)

    replaced, registered = 0, _registered()
    with warnings.catch_warnings():
        # torch warns that a kernel is overridden: that is the point.
        warnings.simplefilter("ignore")
        for name in ops:
            for qualified in _overloads(name, registered):
                short = qualified.split("::", 1)[1]
                for key in BACKEND_KEYS:
                    if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
                        library.impl(short, refuse, key)
                        replaced += 1
    _HELD.append(library)
    return replaced


def refuse_amp_scaler() -> None:
    """Lab 04's loss scaler: GradScaler's unscale and update ops."""
    refusing(AMP_SCALER_OPS, "torch.amp's loss scaling (GradScaler's unscale and update ops) is the library's: "
                             "this item grades your own scaler")


def refuse_fused_adam() -> None:
    """Lab 04's optimizer: torch's fused AdamW and every multi-tensor (_foreach) op, which would do
    per-tensor work in one dispatched call that the step's op count cannot see."""
    refusing(FUSED_ADAM_OPS + foreach_ops(), "torch's fused and multi-tensor (_foreach) optimizer kernels are the "
                                             "library's: this item grades one launch of your kernel")


def refuse_quantizers() -> None:
    """Lab 09's quantiser and fake-quant: torch's quantize and fake-quantize ops."""
    refusing(QUANTIZER_OPS, "torch's quantize and fake-quantize ops are the library's: this item grades your own")
