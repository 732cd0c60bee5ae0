# A realistic mistake: the sampler sorts the whole dataset by length once, in __init__, and serves
# the same batches in the same order every epoch. Padding is as low as it gets, but nothing is ever
# shuffled: every epoch sees the short docstrings first and the long ones last, in fixed company.
# %% grade_id=sampler_code
class BucketBatchSampler(Sampler):
    def __init__(self, lengths, batch_size, *, bucket_size=None, seed=0):
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        by_length = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        self.batches = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            yield batch
