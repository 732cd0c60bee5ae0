# A realistic mistake: gradients are clipped while still multiplied by the loss scale, so the
# threshold is compared with a norm thousands of times too large and every update is shrunk by
# the scale when step() unscales them afterwards.
# %% grade_id=train_step_code
def train_step(model, optimizer, scaler, x, y, loss_fn, max_norm, dtype=torch.bfloat16):
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
