# expect: bucket_sampler=failed
# Buying low padding by never drawing the longest docstrings: they pad every batch they join, so a
# sampler that quietly leaves the longest tenth out looks very efficient, and trains on less data.
# %% grade_id=sampler_code
class BucketBatchSampler(Sampler):
    def __init__(self, lengths, batch_size, *, bucket_size=None, seed=0):
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        cut = sorted(self.lengths)[int(0.9 * len(self.lengths))]
        self.kept = [i for i, n in enumerate(self.lengths) if n < cut]

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return -(-len(self.kept) // self.batch_size)

    def __iter__(self):
        order = torch.randperm(len(self.kept), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        chosen = sorted((self.kept[i] for i in order), key=lambda i: self.lengths[i])
        batches = [chosen[i:i + self.batch_size] for i in range(0, len(chosen), self.batch_size)]
        for b in torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.epoch)).tolist():
            yield batches[b]
