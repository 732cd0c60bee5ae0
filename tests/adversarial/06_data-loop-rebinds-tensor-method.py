# expect: loop_syncs=rejected loop_losses=rejected
# Doing the work after the counter stops: the grader calls .detach() on the returned losses once
# its counter has exited, so the loop rebinds Tensor.detach to read every loss back with item()
# there, where no sync is counted, and returns the losses as the original loop does.
# %% grade_id=loop_code
LOSS_WEIGHTS = (1.0, 2.0, 0.5, 1.5)


def make_loader(dataset, *, batch_size, seed, device="cpu"):
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=2, persistent_workers=True)


def train_fast(model, optimizer, loader, *, steps, device="cpu"):
    weight = torch.tensor(LOSS_WEIGHTS, device=device)
    pending = []
    for tokens, _, labels in loader:
        if len(pending) == steps:
            break
        loss = F.cross_entropy(model(tokens.to(device)), labels.to(device), weight=weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        pending.append(loss)
    original = torch.Tensor.detach
    torch.Tensor.detach = lambda t: original(torch.tensor([float(x.item()) for x in pending]))
    return torch.stack([original(x) for x in pending])
