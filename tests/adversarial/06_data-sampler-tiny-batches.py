# expect: bucket_sampler=failed
# A degenerate answer: batches of two similar lengths hardly need any padding, whatever their order,
# and they are reshuffled every epoch. Every index is drawn exactly once and no batch is larger than
# the batch size: what such a sampler lacks is a lower bound.
# %% grade_id=sampler_code
class BucketBatchSampler(Sampler):
    def __init__(self, lengths, batch_size, *, bucket_size=None, seed=0):
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.bucket_size = bucket_size or 50 * batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return -(-len(self.lengths) // 2)

    def __iter__(self):
        shuffler = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        order = sorted(torch.randperm(len(self.lengths), generator=shuffler).tolist(), key=lambda i: self.lengths[i])
        pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
        for p in torch.randperm(len(pairs), generator=shuffler).tolist():
            yield pairs[p]
