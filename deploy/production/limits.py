"""What each user of the production hub gets: the one place these numbers live.

deploy/production/jupyterhub_config.py reads them for DockerSpawner and KubeSpawner;
z2jh-values.yaml repeats them in the Helm chart's own keys, and tests/test_hub_production.py fails
when the two disagree.

Measured on a development machine (CPU wheels of torch 2.13.0, Python 3.11): a Jupyter server
with nothing open holds 122 MB; a Python process that has imported torch holds 219 MB, and
401 MB once ipykernel, matplotlib, pandas, Triton and fastdl_lab are in as well, the state of a
lab's kernel after its first cell. A CUDA context on a GPU node adds to that (not measured here).
"""

GIB = 1024**3

# The limit is what a graded item may use on the CPU profile (autograder/profiles/cpu.json:
# memory_mb 6144): code that passes the grader's memory limit also runs in the student's own
# server. Beyond it, the kernel is killed, not the node.
MEM_LIMIT = 6 * GIB
# Reserved for every running server: the server and one lab's kernel (0.5 GB measured) and room for
# Validate, which runs the notebook in a second kernel. KubeSpawner schedules pods by it;
# DockerSpawner has no such notion and sets the limits only.
MEM_GUARANTEE = 1 * GIB
# Two cores: lab 07's torch.distributed worlds run several ranks at once, one thread each.
CPU_LIMIT = 2.0
# Most of a class is reading or idle at any moment; half a core each keeps 200 servers on a few nodes.
CPU_GUARANTEE = 0.5
# One GPU (or one MIG slice, by naming its resource) for a student who picks the GPU profile.
GPU_COUNT = 1
# A home volume per user: notebooks, the fetched labs, lab 06's small data sets.
HOME_CAPACITY = "10Gi"

# jupyterhub-idle-culler: a server with no activity for an hour (no request, no message from a
# kernel) is stopped; its home stays. Checked every ten minutes.
CULL_TIMEOUT_S = 3600
CULL_EVERY_S = 600
