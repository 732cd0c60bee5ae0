# expect: loop_speed=failed
# Forging the timed phase as far as a student still can: the grader's clock runs in the grader now,
# so the loop prints the old phase markers (text nobody reads) and makes itself fast by doing the
# work once: the first run trains for real, and every later run returns the first run's losses at
# once, as if it had trained again.
# %% grade_id=loop_code
LOSS_WEIGHTS = (1.0, 2.0, 0.5, 1.5)
PHASE = "\x1efastdl-timing:"


def make_loader(dataset, *, batch_size, seed, device="cpu"):
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=2, persistent_workers=True)


def train_fast(model, optimizer, loader, *, steps, device="cpu", done={}):
    print(PHASE + "end", flush=True)
    print(PHASE + "start", flush=True)
    if "losses" in done:
        return done["losses"].clone()
    weight = torch.tensor(LOSS_WEIGHTS, device=device)
    losses = []
    for tokens, _, labels in loader:
        if len(losses) == steps:
            break
        loss = F.cross_entropy(model(tokens.to(device)), labels.to(device), weight=weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    done["losses"] = torch.stack(losses)
    return done["losses"]
