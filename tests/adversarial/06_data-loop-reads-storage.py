# expect: loop_syncs=rejected loop_losses=rejected
# Reading values where no dispatcher looks: a tensor's storage hands its numbers to Python without
# any op the counter sees. The loop logs every loss this way, a sync on a GPU all the same.
# %% grade_id=loop_code
LOSS_WEIGHTS = (1.0, 2.0, 0.5, 1.5)


def make_loader(dataset, *, batch_size, seed, device="cpu"):
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=2, persistent_workers=True)


def train_fast(model, optimizer, loader, *, steps, device="cpu"):
    weight = torch.tensor(LOSS_WEIGHTS, device=device)
    history = torch.zeros(steps, device=device)
    log = []
    step = 0
    for tokens, _, labels in loader:
        if step == steps:
            break
        loss = F.cross_entropy(model(tokens.to(device)), labels.to(device), weight=weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history[step] = loss.detach()
        log.append(loss.detach().cpu().untyped_storage().tolist())
        step += 1
    return history
