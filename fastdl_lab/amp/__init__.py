"""Mixed precision: fp16, bf16, tf32 and fp8, loss scaling, and what training costs per parameter
(lab 04 amp).

- ``formats``: ``FORMATS`` (the facts of each format, from ``torch.finfo``), ``round_to``, and the
  experiments: overflow, gradient underflow, updates lost to rounding, a long sum that stagnates;
- ``scaler``: ``DynamicLossScaler`` and ``StaticLossScaler`` by hand, to ``torch.amp.GradScaler``'s
  contract, and ``scripted_run`` that puts any scaler through injected overflows;
- ``training``: ``train_step_fp32`` (the reference), ``train_step_amp`` (autocast + scaler), and
  ``underflow_experiment``, a model that fp16 cannot train without a scaler;
- ``memory``: ``RECIPES`` and ``bytes_per_param_ref`` (bytes per parameter on paper) against
  ``training_bytes`` (the bytes actually allocated);
- ``bench``: the benchmark spec, ``benchmark`` and ``check``.

Always give ``torch.amp.GradScaler`` a device (``GradScaler("cpu")``): without one it assumes
CUDA, and on a machine without it disables itself with no more than a warning.
"""

from fastdl_lab.amp.formats import (FORMATS, Format, gradient_sample, gradient_underflow, long_sum_experiment,
                                    lost_update_experiment, overflow_experiment, round_to)
from fastdl_lab.amp.scaler import DynamicLossScaler, StaticLossScaler, scripted_run
from fastdl_lab.amp.training import UNDERFLOW_SETUP, train_step_amp, train_step_fp32, underflow_experiment
from fastdl_lab.amp.memory import (DEFAULT_INT8_BLOCK, DTYPE_BYTES, MOMENTS, RECIPES, bytes_per_param_ref,
                                   training_bytes, validate_recipe)
from fastdl_lab.amp.bench import BENCHMARK, Block, benchmark, check, tiny_transformer

__all__ = ["FORMATS", "Format", "gradient_sample", "gradient_underflow", "long_sum_experiment",
           "lost_update_experiment", "overflow_experiment", "round_to", "DynamicLossScaler", "StaticLossScaler",
           "scripted_run", "UNDERFLOW_SETUP", "train_step_amp", "train_step_fp32", "underflow_experiment",
           "DEFAULT_INT8_BLOCK", "DTYPE_BYTES", "MOMENTS", "RECIPES", "bytes_per_param_ref", "training_bytes",
           "validate_recipe", "BENCHMARK", "Block", "benchmark", "check", "tiny_transformer"]
