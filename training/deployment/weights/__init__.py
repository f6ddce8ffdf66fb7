"""The trainer's side of weight pushes: the safetensors file on /dev/shm or disk (``files.py``) and the
torch.distributed broadcast (``distributed.py``, in buckets: ``buckets.py``). The servers' side is
``training/deployment/server/weight_routes.py`` and ``server/distributed_receiver.py``."""
