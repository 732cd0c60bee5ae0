# expect: loop_syncs=failed loop_losses=failed
# Hiding the syncs in another process: the counter watches the training thread, so the whole slow
# loop (item() every step and all) runs inside a DataLoader worker, and the training thread only
# receives the finished list of losses, with no sync of its own. The worker trains a copy of the
# model, though: the one the grader handed over never moves.
# %% grade_id=loop_code
LOSS_WEIGHTS = (1.0, 2.0, 0.5, 1.5)
SHARED = {}


def make_loader(dataset, *, batch_size, seed, device="cpu"):
    SHARED["seed"] = seed
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=2, persistent_workers=True)


class TrainingAsData:
    def __init__(self, model, optimizer, loader, steps):
        self.model, self.optimizer, self.loader, self.steps = model, optimizer, loader, steps

    def __len__(self):
        return 1

    def __getitem__(self, index):
        data = self.loader.dataset
        batches = DataLoader(data, batch_size=self.loader.batch_size, sampler=shuffle_sampler(data, SHARED["seed"]),
                             collate_fn=pad_collate)
        weight = torch.tensor(LOSS_WEIGHTS)
        losses = []
        for tokens, _, labels in batches:
            if len(losses) == self.steps:
                break
            loss = F.cross_entropy(self.model(tokens), labels, weight=weight)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())
        return torch.tensor(losses)


def train_fast(model, optimizer, loader, *, steps, device="cpu"):
    elsewhere = DataLoader(TrainingAsData(model, optimizer, loader, steps), batch_size=None, num_workers=1)
    for losses in elsewhere:
        return losses
