"""``ServerActor``: the Ray actor of one inference server (a plain class; ``replicas.py`` wraps it with
``ray.remote`` and schedules it into its replica's bundle).

It runs the backend's own ``ServerProcess`` (``make_deployment``'s class: the embedded server, vLLM or SGLang,
supervised and restarted on its node as on one machine), bound to the node's address (the caller's config carries an
API key, which a non-loopback bind requires) and, for the embedded server, accepting the trainer's node as a
``--weight-peer`` (the distributed push's store). ``start()`` answers ``{"url", "node", "pid"}``; ``wait_exit()``
returns only after ``stop()``, so a caller that holds its reference sees the actor die without polling it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Sequence

from training.deployment.backends.registry import backend, load_class
from training.launch.node import node_address, node_label
from training.utils.config import DeployConfig


class ServerActor:
    """One inference server on this actor's node."""

    def __init__(self, model: str, cfg: DeployConfig, log_file: str, weight_peers: Sequence[str] = ()):
        cfg = dataclasses.replace(cfg, host=node_address())
        facts = backend(cfg.engine)
        extra = [a for p in weight_peers for a in ("--weight-peer", p)] if facts.weight_peer_flag else []
        self.server = load_class(facts.deployment)(model, cfg, log_file=log_file, extra_args=extra)
        self._gone = threading.Event()

    def start(self) -> dict:
        """Start the server and say where it runs."""
        self.server.start()
        return {"url": self.server.base_url, "node": node_label(), "pid": os.getpid()}

    def wait_exit(self) -> None:
        """Return once ``stop`` ran (the caller's reference fails instead when this actor dies)."""
        self._gone.wait()

    def stop(self) -> None:
        self.server.stop()
        self._gone.set()
