"""What the two halves of lab 04's grading share: the names graded code may use, and seeds."""

from __future__ import annotations

import torch

# Names the extracted classes and functions may use, bound by the child before they are defined.
SCOPE = (
    "import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
    "import triton\nimport triton.language as tl\nfrom fastdl_lab.optim import multi_tensor_table\n"
)
# torch.amp, GradScaler, the package's DynamicLossScaler, Adam and AdamW in any of their homes.
LIBRARY = r"^amp$|scaler|adam"


def refusing(refusal: str) -> str:
    """``SCOPE`` followed by one of ``autograder.labs._refusals``' refusals: the library's ops of the
    item's technique refused at the dispatcher before the student's definitions exist."""
    return SCOPE + f"from autograder.labs._refusals import {refusal} as _refuse\n_refuse()\ndel _refuse\n"


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed % (1 << 63))
