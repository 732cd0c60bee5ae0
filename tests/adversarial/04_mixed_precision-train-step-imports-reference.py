# expect: amp_train_step=rejected
# Reading the answers: the training step imports the package's reference step at call time.
# %% grade_id=train_step_code
import torch


def train_step(model, optimizer, scaler, x, y, loss_fn, max_norm, dtype=torch.bfloat16):
    from fastdl_lab.amp import train_step_amp

    return train_step_amp(model, optimizer, scaler, x, y, loss_fn, dtype=dtype, max_norm=max_norm)
