"""Below 16 bits: int8 quantisation, a W8A8 Triton matmul, QAT against PTQ, and inference-time
fusion (lab 09 custom ops and quantisation).

- ``formats``: ``quantize`` / ``dequantize`` (per tensor or per channel, symmetric or not),
  ``quantize_per_channel_ref`` (graded) with ``check_per_channel``, ``dynamic_activation_scale``,
  ``quantization_error``, and ``trained_layer``, a real layer to measure them on;
- ``w8a8``: ``int8_matmul_ref``, the Triton kernel and its launcher ``int8_matmul``
  (int8 tensor cores on a GPU, exact under the interpreter), ``ptx``, ``W8A8Linear``;
- ``training``: ``fake_quant`` with a straight-through estimator (``FakeQuantSTE``, graded), ``ptq``
  and ``qat`` on a small MLP whose 4-bit PTQ loses much of its accuracy and whose QAT gets most
  of it back;
- ``fusion``: BatchNorm folded into the Linear before it (lab 02's fold, reused), ``bn_mlp``,
  ``forward_ops``;
- ``bench``: the benchmark spec, ``benchmark`` and ``check``.

Google's TPUs are integer and low-precision matrix machines. The first TPU (in service from 2015)
served only inference: a co-processor on the PCIe bus whose core is a 256 x 256 systolic array of
8-bit multiply-accumulate cells, 65,536 of them, with 32-bit accumulators, so a model ran there
quantised to int8. Its successor, TPU v2, was built for training as well, and its matrix units
multiply in bfloat16 and accumulate in fp32, the pairing that mixed-precision training (lab 04)
uses on GPUs.
"""

from fastdl_lab.quant.formats import (REGRESSION, check_per_channel, dequantize, dynamic_activation_scale,
                                      one_thread, qrange, quantization_error, quantize, quantize_activation,
                                      quantize_per_channel_ref, row_range_ratio, train_regression_mlp,
                                      trained_layer)
from fastdl_lab.quant.w8a8 import (MAX_K, W8A8Linear, _int8_matmul_kernel, check_int8_matmul, int8_matmul,
                                          int8_matmul_ref, ptx, quantize_linears)
from fastdl_lab.quant.training import (SETUP, FakeQuantSTE, QuantLinear, Task, accuracy, experiment, fake_quant,
                                  make_model, make_task, ptq, qat, quantize_model, round_to_grid, train_float)
from fastdl_lab.quant.fusion import bn_mlp, fold_linear_bn, fold_linear_bn_model, forward_ops
from fastdl_lab.quant.bench import BENCHMARK, benchmark, check

__all__ = ["REGRESSION", "check_per_channel", "dequantize", "dynamic_activation_scale", "one_thread", "qrange",
           "quantization_error", "quantize", "quantize_activation", "quantize_per_channel_ref", "row_range_ratio",
           "train_regression_mlp", "trained_layer", "MAX_K", "W8A8Linear", "_int8_matmul_kernel",
           "check_int8_matmul", "int8_matmul", "int8_matmul_ref", "ptx", "quantize_linears", "SETUP",
           "FakeQuantSTE", "QuantLinear", "Task", "accuracy", "experiment", "fake_quant", "make_model",
           "make_task", "ptq", "qat", "quantize_model", "round_to_grid", "train_float", "bn_mlp", "fold_linear_bn",
           "fold_linear_bn_model", "forward_ops", "BENCHMARK", "benchmark", "check"]
