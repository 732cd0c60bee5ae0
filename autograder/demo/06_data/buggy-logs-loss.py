# A realistic mistake: the loop is fixed, except that it still prints the loss every fifth step, as
# everyone likes to watch it fall. Each print reads the loss back: a sync that stops the device, and
# the trainer cannot queue the next step until the device has caught up.
# %% grade_id=loop_code
LOSS_WEIGHTS = (1.0, 2.0, 0.5, 1.5)


def make_loader(dataset, *, batch_size, seed, device="cpu"):
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=2, prefetch_factor=4, persistent_workers=True,
                      pin_memory=str(device).startswith("cuda"))


def train_fast(model, optimizer, loader, *, steps, device="cpu"):
    weight = torch.tensor(LOSS_WEIGHTS, device=device)
    history = torch.zeros(steps, device=device)
    step = 0
    while step < steps:
        for tokens, _, labels in loader:
            if step == steps:
                break
            loss = F.cross_entropy(model(tokens.to(device, non_blocking=True)), labels.to(device, non_blocking=True),
                                   weight=weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history[step] = loss.detach()
            if step % 5 == 0:
                print(f"step {step}: loss {loss:.4f}")
            step += 1
    return history
