"""Profiling and feeding the device (lab 06 data).

- ``syncs``: ``SyncCounter``, which counts what a training step makes the host wait for;
- ``profile``: torch.profiler traces and their summary, FLOPs and MFU of a step;
- ``loop``: a training loop with planted inefficiencies beside its fixed version;
- ``loaders``: a dataset with a real per-item decode and augment cost, DataLoader throughput;
- ``images``: decoding JPEGs and augmenting on the host or the device;
- ``text``: padding, length bucketing and sequence packing on real text lengths.
- ``transfer``: host-to-device copies, pageable and pinned, against a matmul on the device.
"""
