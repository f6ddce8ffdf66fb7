"""``DeploymentGroup``: the servers a run samples from, and the one way new weights reach them.

    group = DeploymentGroup(model_path, cfg.deployment, log_dir=log_path).start(tokenizer)
    completions = await group.sampler.sample_with_prompt_tokens(ids)
    await group.push(trainer.named_weights(), version, specs=trainer.weight_specs())
    group.stop()

Replicas: with ``cfg.base_url`` None the group launches ``cfg.num_replicas`` servers of
``cfg.engine``, placed by ``plan_placement`` (``placement.py``: each on its own devices, refused
at construction when the placement cannot work; logged once) (each supervised: a dead one is restarted with the latest weights; each locked with
``cfg.api_key``, a random one when none is given); with URLs it
attaches one server-process object per URL. The sampler balances requests over them with
session affinity (``client.py``); for launched replicas it asks ``replica_status`` before each
request, so requests wait for a restarting replica and resume once it is back (``client.py``, "Restarts").

``push`` is the whole weight sync, for every engine:

- ``shm`` / ``disk``: the weights are written ONCE to ``<folder>/model.safetensors``
  (``WeightFolder``: /dev/shm for ``shm``, ``<log_dir>/weights`` for ``disk``) and loaded into
  every replica concurrently through that engine's endpoint (``ServerProcess.load_weights``). A
  launched replica that is dead is restarted first; a load that fails because the replica died
  meanwhile is retried once after its restart. Each replica records the folder and version, so a
  later restart comes back with them.
- ``distributed``: tensors are broadcast to every server over a torch.distributed group
  (``DistributedWeightSender``; for vLLM ``VLLMWeightSender``, the backend's ``weight_sender``), in buckets of
  ``cfg.weight_bucket_mb``.

Every path sends the servers' own dtype: the first push asks each replica (``weight_dtype``,
``GET /weight_version``) and, when they agree, casts each floating-point tensor just before it is
written or broadcast (fp32 master weights reach a bf16 server as bf16 bytes). A shm push first
checks what the write needs in /dev/shm (``WeightFolder.placement``): the new file beside the old
one, else (one log line) the old one removed first; when not even one copy fits, that push goes to
disk (``weights_dir``, else a temp folder) with one warning.

It returns once every replica serves ``weight_version``; then the sampler labels completions of
servers that report no version with it (``DeploymentSampler.note_weight_version``). ``hooks``
(``(before, after)`` coroutine pairs, e.g. the proxy's pause/drain) run around every push.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence

from training.deployment.backends.registry import backend, load_class, make_deployment, make_sampler
from training.deployment.placement import Placement, ReplicaPlacement, plan_placement
from training.deployment.backends.process import ServerProcess
from training.deployment.client import ReplicaStatus
from training.deployment.weights.files import WeightFolder, WeightSyncError, weights_nbytes
from training.utils.config import DeployConfig, TrainerConfig
from training.utils.engine_choice import resolve_engine

log = logging.getLogger(__name__)

WeightSyncHook = tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]


def replica_config(cfg: DeployConfig, index: int, placement: Optional[ReplicaPlacement] = None) -> DeployConfig:
    """``cfg`` for replica ``index``: its engine seed is the group's seed (0 if unset) + ``index``, so two
    replicas never hand the same generator seeds to their requests; with ``placement``, its
    ``replica_devices`` names that replica's own devices (``placement.py``)."""
    if placement is not None:
        cfg = dataclasses.replace(cfg, replica_devices=[placement.label])
    if cfg.num_replicas == 1 and index == 0:
        return cfg
    seed = (cfg.engine_config.seed or 0) + index
    return dataclasses.replace(cfg, engine_config=dataclasses.replace(cfg.engine_config, seed=seed))


class DeploymentGroup:
    """Replicas (launched or attached), their sampler, and weight pushes to all of them at once."""

    def __init__(
        self,
        model: str,
        cfg: DeployConfig,
        *,
        log_dir: Optional[str | Path] = None,
        weights_dir: Optional[str | Path] = None,
        replicas: Optional[list[ServerProcess]] = None,
        trainer: Optional[TrainerConfig] = None,
    ):
        cfg, choice = resolve_engine(cfg)  # engine="auto" (the recipes resolve it first, so it is logged once)
        if choice.line:
            log.info("%s", choice.line)
        self.model = model
        self.trainer = trainer
        """The run's trainer settings, for the placement (None: ``TrainerConfig()``'s devices)."""
        self.placement: Optional[Placement] = None
        """Where the trainer and each launched replica run (``placement.py``); None when attached."""
        if cfg.base_url is None and replicas is None and cfg.api_key is None:
            cfg = dataclasses.replace(cfg, api_key=secrets.token_urlsafe(24))
        self.cfg = cfg
        """The deployment config; a group that launches its servers without a key gets a random one
        (``cfg.api_key``), which its sampler and pushes send, so no other local process can pause the
        servers or load weights into them."""
        self.log_dir = Path(log_dir) if log_dir is not None else None
        """Where launched servers write their logs (``deployment.log``, ``deployment-<i>.log``)."""
        self.weights_dir = (
            Path(weights_dir)
            if weights_dir is not None
            else (self.log_dir / "weights" if self.log_dir is not None else None)
        )
        """Where ``weight_sync="disk"`` writes ``model.safetensors`` (default ``<log_dir>/weights``)."""
        self.replicas: list[ServerProcess] = replicas if replicas is not None else self._make_replicas()
        self.sampler: Any = None
        """The ``DeploymentSampler`` over every replica (set by ``start``)."""
        self.hooks: list[WeightSyncHook] = []
        """``(before, after)`` coroutine functions run around every push (``RolloutSetup.weight_sync_hooks``)."""
        self._folder: Optional[WeightFolder] = None
        self._disk_folder: Optional[WeightFolder] = None
        """Where a shm push that does not fit in /dev/shm is written instead."""
        self._wire_dtype: Optional[str] = None
        """The replicas' weight dtype name ("" when they do not say or disagree), asked at the first push."""
        self._sender = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2, len(self.replicas)), thread_name_prefix="weight-push"
        )
        for r in self.replicas:
            r.on_moved = self.replica_moved

    @classmethod
    def attach(
        cls,
        base_urls: Sequence[str],
        cfg: Optional[DeployConfig] = None,
        *,
        model: str = "",
        weights_dir: Optional[str | Path] = None,
    ) -> "DeploymentGroup":
        """A group over running servers of ``cfg.engine`` (no launch, no restart)."""
        cfg = cfg or DeployConfig()
        return cls(
            model, cfg, weights_dir=weights_dir, replicas=[make_deployment(model, cfg, base_url=u) for u in base_urls]
        )

    def _make_replicas(self) -> list[ServerProcess]:
        cfg = self.cfg
        if cfg.base_url is not None:
            urls = [cfg.base_url] if isinstance(cfg.base_url, str) else list(cfg.base_url)
            return [make_deployment(self.model, cfg, base_url=u) for u in urls]
        self.placement = plan_placement(cfg, self.trainer)
        log.info("%s", self.placement.describe())
        replicas = []
        for i in range(cfg.num_replicas):
            if cfg.log_file:
                log_file = cfg.log_file if cfg.num_replicas == 1 else f"{cfg.log_file}.{i}"
            elif self.log_dir is not None:
                log_file = str(self.log_dir / ("deployment.log" if cfg.num_replicas == 1 else f"deployment-{i}.log"))
            else:
                log_file = None
            rcfg = replica_config(cfg, i, self.placement.replicas[i])
            replicas.append(make_deployment(self.model, rcfg, log_file=log_file))
        return replicas

    # ------------------------------------------------------------ lifecycle
    @property
    def base_urls(self) -> list[str]:
        return [r.base_url for r in self.replicas]

    @property
    def launched(self) -> bool:
        """True when the group started its servers (False: attached to servers someone else runs)."""
        return any(r.attached_url is None for r in self.replicas)

    @property
    def weight_sync_mode(self) -> str:
        """``cfg.weight_sync`` with ``auto`` resolved: shm for launched servers, disk for attached ones."""
        mode = self.cfg.weight_sync
        if mode == "auto":
            return "shm" if self.launched else "disk"
        return mode

    def start(self, tokenizer: Any = None) -> "DeploymentGroup":
        """Start (or check) every replica, then build the sampler. Stops what started if one fails."""
        try:
            for r in self.replicas:
                r.start()
        except BaseException:
            self.stop()
            raise
        self.sampler = make_sampler(self.base_urls, self.cfg, tokenizer=tokenizer)
        if self.launched:  # requests wait for a restarting replica instead of spending their retries
            self.sampler.set_readiness(self.replica_status)
        return self

    def replica_status(self, url: str) -> Optional[ReplicaStatus]:
        """The ``ReplicaStatus`` of the replica at ``url`` (``ServerProcess.status``; None when attached or unknown)."""
        for r in self.replicas:
            if r.base_url == url:
                return r.status()
        return None

    def replica_moved(self, old_url: str, new_url: str) -> None:
        """A replica restarted at another address (``ServerProcess.on_moved``): the sampler sends its requests there and
        the next distributed push forms a new group with it."""
        log.info("replica %s moved to %s", old_url, new_url)
        if self.sampler is not None:
            self.sampler.replace_replica(old_url, new_url)

    @property
    def restart_count(self) -> int:
        """Restarts of every replica so far (``ServerProcess.restarts``)."""
        return sum(r.restart_count for r in self.replicas)

    def __enter__(self) -> "DeploymentGroup":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop launched replicas, remove the /dev/shm weights, leave the distributed group. Idempotent."""
        for r in self.replicas:
            r.stop()
        if self._folder is not None:
            self._folder.remove()
            self._folder = None
        if self._disk_folder is not None and self.weights_dir is None:  # the temp folder of a shm fallback
            shutil.rmtree(self._disk_folder.folder, ignore_errors=True)
            self._disk_folder = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self._pool.shutdown(wait=False)

    async def close_sampler(self) -> None:
        """Close the sampler's connections of the running event loop."""
        if self.sampler is not None:
            await self.sampler.close()

    async def server_stats(self) -> list[Optional[dict]]:
        """``GET /stats`` of every replica at once (``ServerProcess.stats``: None where it has none)."""
        return list(await asyncio.gather(*(asyncio.to_thread(r.stats) for r in self.replicas)))

    # ------------------------------------------------------------ sleep (colocation)
    async def sleep(self, level: int) -> list[dict]:
        """``POST /sleep?level=N`` on every replica at once (the colocated step's first phase: the trainer trains
        next); each replica's answer."""
        return list(await asyncio.gather(*(asyncio.to_thread(r.sleep, level) for r in self.replicas)))

    async def wake_up(self) -> list[dict]:
        """``POST /wake_up`` on every replica at once (the colocated step's last phase, after the push); each
        replica's answer."""
        return list(await asyncio.gather(*(asyncio.to_thread(r.wake_up) for r in self.replicas)))

    # ------------------------------------------------------------ weights
    async def push(
        self,
        named_weights: Iterable[tuple[str, Any]],
        weight_version: int,
        *,
        specs: Optional[Sequence[tuple[str, Any, tuple[int, ...]]]] = None,
        wait_for_inflight: bool = True,
        force: bool = False,
    ) -> dict:
        """Load new weights into every replica as ``weight_version`` (see the module docstring).

        ``specs`` (``(name, dtype, shape)`` per tensor, e.g. ``PolicyTrainer.weight_specs()``) lets the
        distributed path stream a lazy iterator; the file paths ignore it. ``force`` lets a version
        older than the served one load (a run's first push to a server an earlier run left ahead).
        Returns timings
        (``total_s`` and the path's own). Raises ``WeightSyncError`` naming the replica that refused.
        """
        t0 = time.perf_counter()
        for before, _ in self.hooks:
            await before()
        try:
            dtype = await self.wire_dtype()
            if self.weight_sync_mode == "distributed":
                out = await self._push_distributed(named_weights, weight_version, specs, wait_for_inflight, dtype)
            else:
                out = await self._push_file(named_weights, weight_version, wait_for_inflight, force, specs, dtype)
            out["dtype"] = str(dtype).removeprefix("torch.") if dtype is not None else None
            if self.sampler is not None:
                self.sampler.note_weight_version(weight_version)
        finally:
            for _, after in self.hooks:
                await after()
        out["total_s"] = time.perf_counter() - t0
        return out

    async def wire_dtype(self) -> Any:
        """The torch dtype the replicas hold their weights in (a push casts to it), or None when none says
        (vLLM, SGLang) or they disagree: the trainer's dtype is then sent. Asked at each push until
        every replica has answered, then kept."""
        from training.deployment.weights.distributed import DTYPES

        if self._wire_dtype is not None:
            return DTYPES.get(self._wire_dtype)
        loop = asyncio.get_running_loop()
        names = await asyncio.gather(*(loop.run_in_executor(self._pool, r.weight_dtype) for r in self.replicas))
        known = {n for n in names if n is not None}
        if len(known) > 1:
            log.warning("replicas hold different weight dtypes %s: pushes send the trainer's dtype", names)
        wire = next(iter(known)) if len(known) == 1 and next(iter(known)) in DTYPES else ""
        if None not in names or len(known) > 1:  # a replica that did not say (down, another engine): ask again
            self._wire_dtype = wire
        return DTYPES.get(wire)

    def _file_folder(self, specs: Sequence[tuple[str, Any, tuple[int, ...]]], dtype: Any) -> tuple[WeightFolder, bool]:
        """The folder this push writes to (the mode's own, or disk when a shm file would not fit) and
        whether the old file must be removed first (only one copy fits in /dev/shm)."""
        mode = self.weight_sync_mode
        if self._folder is None:
            if mode == "disk" and self.weights_dir is None:
                raise ValueError("weights_dir: required for weight_sync='disk' (where the weights file goes)")
            self._folder = WeightFolder(mode, None if mode == "shm" else str(self.weights_dir))
        if mode != "shm":
            return self._folder, False
        need = weights_nbytes(specs, dtype)
        place = self._folder.placement(need)
        if place == "beside":
            return self._folder, False
        if place == "in_place":
            log.info(
                "the weights (%.1f MB) fit in %s only in place of the previous file: it is removed before the "
                "new one is written (a server restarted meanwhile finds no file until the write ends)",
                need / 2**20,
                self._folder.folder.parent,
            )
            return self._folder, True
        if self._disk_folder is None:
            directory = self.weights_dir or tempfile.mkdtemp(prefix="training-weights-disk-")
            self._disk_folder = WeightFolder("disk", str(directory))
        log.warning(
            "the weights (%.1f MB) do not fit in the free space of %s: writing them to %s instead",
            need / 2**20,
            self._folder.folder.parent,
            self._disk_folder.folder,
        )
        return self._disk_folder, False

    async def _push_file(
        self,
        named_weights: Iterable[tuple[str, Any]],
        weight_version: int,
        wait_for_inflight: bool,
        force: bool,
        specs: Optional[Sequence[tuple[str, Any, tuple[int, ...]]]] = None,
        dtype: Any = None,
    ) -> dict:
        if specs is None:
            named_weights = list(named_weights)  # references: the specs are read from them
            specs = [(n, t.dtype, tuple(t.shape)) for n, t in named_weights]
        target, in_place = self._file_folder(specs, dtype)
        mode = target.mode
        loop = asyncio.get_running_loop()
        write = await loop.run_in_executor(self._pool, target.write, named_weights, dtype, in_place)
        t1 = time.perf_counter()
        folder = str(target.folder)
        answers = await asyncio.gather(
            *(
                loop.run_in_executor(self._pool, self._load, r, folder, weight_version, mode, wait_for_inflight, force)
                for r in self.replicas
            )
        )
        return {
            "path": str(target.file),
            "mode": mode,
            **write,
            "load_s": time.perf_counter() - t1,
            "servers": dict(zip(self.base_urls, answers)),
        }

    def _load(
        self,
        replica: ServerProcess,
        folder: str,
        weight_version: int,
        mode: str,
        wait_for_inflight: bool,
        force: bool = False,
    ) -> dict:
        """Load into one replica (blocking): restart it first if dead; retry once if it died during the load."""
        replica.ensure_alive()
        restarts = replica.restart_count
        try:
            answer = replica.load_weights(
                folder, weight_version, mode=mode, wait_for_inflight=wait_for_inflight, force=force
            )
        except WeightSyncError:
            if not replica.recover(restarts):
                raise  # a refusal by a live server (its old weights stay), or an attached server
            log.warning(
                "%s died during the weight push of v%d; retrying after its restart", replica.base_url, weight_version
            )
            answer = replica.load_weights(
                folder, weight_version, mode=mode, wait_for_inflight=wait_for_inflight, force=force
            )
        replica.note_weights(folder, weight_version, mode)
        return answer

    async def _push_distributed(
        self,
        named_weights: Iterable[tuple[str, Any]],
        weight_version: int,
        specs: Optional[Sequence[tuple[str, Any, tuple[int, ...]]]],
        wait_for_inflight: bool,
        dtype: Any,
    ) -> dict:
        """The distributed push. Launched replicas that are dead are restarted first (a restart in progress is waited
        for), and a group whose members changed address is formed anew; each replica then hears ``weights_arrived``.
        A push that failed before its broadcast because a launched replica died under it is tried once more after the
        restart (with ``specs`` the weights are read only during the broadcast, so such a push has read none)."""
        loop = asyncio.get_running_loop()
        if self.launched:
            await asyncio.gather(*(loop.run_in_executor(self._pool, r.ensure_alive) for r in self.replicas))
        restarts = [r.restart_count for r in self.replicas]
        sender = self._distributed_sender()
        try:
            out = await sender.push(
                named_weights, weight_version, specs=specs, wait_for_inflight=wait_for_inflight, dtype=dtype
            )
        except WeightSyncError:
            if specs is None or sender.broadcast_started or not self.launched:
                raise
            recovered = await asyncio.gather(
                *(loop.run_in_executor(self._pool, r.recover, n) for r, n in zip(self.replicas, restarts))
            )
            if not any(recovered):
                raise
            log.warning("a replica died during the weight push of v%d; retrying after its restart", weight_version)
            out = await self._distributed_sender().push(
                named_weights, weight_version, specs=specs, wait_for_inflight=wait_for_inflight, dtype=dtype
            )
        for r in self.replicas:
            r.weights_arrived(weight_version)
        return out

    def _distributed_sender(self):
        """The weight sender of ``weight_sync="distributed"``, connected to every server on first use (again when a
        replica moved: ``replica_moved``)."""
        if self._sender is not None and list(self._sender.base_urls) != [u.rstrip("/") for u in self.base_urls]:
            self._sender.close()
            self._sender = None
        if self._sender is None:
            d = self.cfg
            self._sender = load_class(backend(d.engine).weight_sender).from_replicas(
                self.replicas,
                d.weight_sync_master_addr,
                master_port=d.weight_sync_master_port,
                backend=d.weight_sync_backend,
                api_key=d.api_key,
                timeout_s=d.request_timeout_s,
                bucket_bytes=int(d.weight_bucket_mb * 2**20),
            )
        return self._sender


async def push_weights(
    base_urls: str | Sequence[str],
    named_weights: Iterable[tuple[str, Any]],
    weight_version: int,
    *,
    mode: str = "shm",
    directory: Optional[str] = None,
    api_key: Optional[str] = None,
    wait_for_inflight: bool = True,
) -> dict:
    """One push to running servers of this package (no launch): write once, load into each, clean up.

    ``mode="disk"`` writes ``<directory>/model.safetensors`` (kept); ``shm`` writes a /dev/shm file that
    is removed afterwards. Returns the timings of ``DeploymentGroup.push``.
    """
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise ValueError("base_urls: at least one server is needed")
    if mode == "disk" and not directory:
        raise ValueError("directory: required with mode='disk'")
    group = DeploymentGroup.attach(urls, DeployConfig(api_key=api_key, weight_sync=mode), weights_dir=directory)
    try:
        return await group.push(named_weights, weight_version, wait_for_inflight=wait_for_inflight)
    finally:
        group.stop()
