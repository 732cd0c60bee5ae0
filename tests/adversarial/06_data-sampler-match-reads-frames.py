# expect: bucket_sampler=rejected
# Reaching the grader's state without an attribute: a match statement's class pattern reads any
# attribute it names, here a generator's frame and from it the caller's locals, where the grading
# runner keeps the hidden lengths and the measuring objects. The sampler then hands out batches of
# whatever it found, sorted once.
# %% grade_id=sampler_code
class BucketBatchSampler(Sampler):
    def __init__(self, lengths, batch_size, *, bucket_size=None, seed=0):
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.epoch = 0
        probe = (x for x in [0])
        match probe:
            case object(gi_frame=frame):
                self.found = frame
            case _:
                self.found = None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return -(-len(self.lengths) // self.batch_size)

    def __iter__(self):
        order = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        for start in range(0, len(order), self.batch_size):
            yield order[start:start + self.batch_size]
