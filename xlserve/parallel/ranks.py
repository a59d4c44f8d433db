"""The processes of one tensor- and/or pipeline-parallel worker. The worker itself is rank
0: it starts the other ranks (``python -m xlserve.parallel.follower``), joins them in one
torch.distributed group, and each engine step broadcasts the step's plan (``rank_plan.py``)
before running its own part of the forward; the others run theirs on the same plan. KV
exports and imports (the prefill/decode hand-off) gather and scatter the other ranks' parts
(heads, layer slots) the same way.

Rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``. Groups: the
world, whose point-to-point transfers between stages and KV moves time out after
``--distributed-timeout``; each stage's tensor-parallel group (all-reduce, all-gather), with
the same timeout, so a dead or hung rank fails the worker instead of hanging it; and the
plan group, on which idle ranks wait for the next step for as long as the worker lives
(they die with it: the kernel signals them when it exits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import hmac
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import torch
from pydantic import BaseModel, ConfigDict, Field

from xlserve.config import EngineConfig
from xlserve.engine.errors import FATAL_ERRORS, EngineFatal, describe
from xlserve.engine.kv_blocks import KVShards
from xlserve.layers.attention import DecodePath
from xlserve.parallel import expert_exchange, pipeline_parallel, tensor_parallel
from xlserve.parallel.rank_plan import PlanKind, RankPlan, send_plan
from xlserve.parallel.tensor_parallel import as_bytes
from xlserve.supervisor import die_with_parent, exit_cause

log = logging.getLogger(__name__)
IDLE_WAIT = datetime.timedelta(days=3650)  # the plan group: idle ranks wait while the worker lives


class RankSpec(BaseModel):
    """What a started rank reads on its standard input (never on its command line)."""
    model_config = ConfigDict(extra="forbid")
    engine: dict  # EngineConfig as flat keyword arguments
    rank: int = Field(ge=1)
    size: int = Field(ge=2)
    init_method: str


def flat_options(config: EngineConfig) -> dict:
    """``EngineConfig.from_kwargs`` rebuilds ``config`` from these."""
    return {name: value for sub in (config.model, config.cache, config.scheduler, config.parallel, config.speculative)
            for name, value in dataclasses.asdict(sub).items()}


def join(init_method: str, rank: int, config: EngineConfig):
    """This process into the group as ``rank``; sets ``tensor_parallel.current()`` (or with
    data-parallel attention ``expert_exchange.current()``) and ``pipeline_parallel.current()``
    (its layers follow once the model's are known). Returns the plan group."""
    import torch.distributed as dist
    p = config.parallel
    size, tp = p.world_size, p.tensor_parallel_size
    cuda = on_cuda(config)
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size // p.nnodes)))
    timeout = datetime.timedelta(seconds=p.distributed_timeout)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout)
    key = distributed_key(config)
    if key:
        authenticate(key.encode())
    plan_group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
    # every rank creates every stage's group, in the same order (torch.distributed requires it)
    stage_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout)
                    for s in range(p.pipeline_parallel_size)] if p.pipeline_parallel_size > 1 else [dist.group.WORLD]
    if p.data_parallel_attention:  # every layer whole but the routed experts, which tokens travel to
        expert_exchange.set_current(expert_exchange.ExpertExchange(rank, size, dist.group.WORLD))
    else:
        tensor_parallel.set_current(tensor_parallel.TensorParallel(rank % tp, tp, stage_groups[rank // tp],
                                                                   p.expert_parallel))
    pipeline_parallel.set_current(pipeline_parallel.PipelineStage(rank // tp, p.pipeline_parallel_size, rank=rank,
                                                                  tp_size=tp))
    return plan_group


def on_cuda(config: EngineConfig) -> bool:
    """Whether the ranks run on CUDA (NCCL, a device each) or on the CPU (gloo)."""
    device = config.model.device
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


@contextlib.contextmanager
def out_of_step():
    """A failure between ranks (one died, hung past --distributed-timeout, or a collective
    broke half way) leaves them out of step for good: fatal, so the worker exits and is restarted."""
    try:
        yield
    except FATAL_ERRORS:
        raise
    except Exception as e:
        raise EngineFatal(f"the worker's ranks are out of step: {describe(e)}") from e


def agree(loaded, num_blocks: int, block_size: int) -> None:
    """Every rank must hold a slice of the same model with the same KV pool (other nodes start
    from their own flags): a digest of each compared once, after loading, on every rank."""
    import torch.distributed as dist
    what = f"{loaded.arch!r}|{loaded.dtype}|{num_blocks}|{block_size}"
    with out_of_step():
        digests = _all_gather_bytes(hashlib.sha256(what.encode()).digest(), dist.get_world_size())
    differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(f"ranks {differ} load another model, dtype or KV pool than rank 0: give every node the "
                         "same --model, --dtype and KV-cache flags")


def distributed_key(config: EngineConfig, environ=os.environ) -> str:
    """The key the ranks prove they hold: from --distributed-key-file or XLSERVE_DISTRIBUTED_KEY
    (never a command line); required when ranks meet over the network (several nodes)."""
    from xlserve.server_config import read_key
    p = config.parallel
    key = read_key(p.distributed_key_file, "distributed key") if p.distributed_key_file else \
        environ.get("XLSERVE_DISTRIBUTED_KEY", "")
    if p.nnodes > 1 and not key:
        raise ValueError("ranks on several nodes meet over the network: give every node the same "
                         "--distributed-key-file (or XLSERVE_DISTRIBUTED_KEY)")
    return key


def authenticate(key: bytes) -> None:
    """Every rank proves it holds ``key`` before anything else moves: each contributes a fresh
    nonce, and every rank checks each rank's HMAC-SHA256 over all the nonces and its rank. A
    process that reached --master-port without the key cannot take a rank's place (the
    worker refuses to start), and a recorded handshake does not replay (the nonces are new)."""
    import torch.distributed as dist
    size, rank = dist.get_world_size(), dist.get_rank()
    with out_of_step():
        transcript = b"".join(_all_gather_bytes(os.urandom(32), size))

    def tag(r: int) -> bytes:
        return hmac.new(key, transcript + r.to_bytes(4, "big"), hashlib.sha256).digest()
    with out_of_step():
        tags = _all_gather_bytes(tag(rank), size)
    impostors = [r for r, t in enumerate(tags) if not hmac.compare_digest(t, tag(r))]
    if impostors:
        raise ValueError(f"ranks {impostors} did not prove they hold the distributed key: give every node the "
                         "same --distributed-key-file, and keep --master-port on a private network")


def _all_gather_bytes(data: bytes, size: int) -> list[bytes]:
    """Every rank's ``data`` (the same length on each), in rank order."""
    import torch.distributed as dist
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(
        "cuda" if dist.get_backend() == "nccl" else "cpu")  # NCCL moves device tensors only
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine)
    return [p.cpu().numpy().tobytes() for p in parts]


def leave() -> None:
    import torch.distributed as dist
    tensor_parallel.set_current(tensor_parallel.TensorParallel())
    expert_exchange.set_current(expert_exchange.ExpertExchange())
    pipeline_parallel.set_current(pipeline_parallel.PipelineStage())
    if dist.is_initialized():
        dist.destroy_process_group()


def rendezvous(config: EngineConfig) -> str:
    """Where the ranks meet: node 0's --master-addr and --master-port; on one machine, a file in
    a directory only this user can open (no listening socket), and gloo's connections on the
    loopback interface."""
    p = config.parallel
    if p.nnodes > 1 or p.master_port:
        distributed_key(config)  # refused before any rank starts when it is missing
        return f"tcp://{p.master_addr}:{p.master_port}"
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback:  # inherited by the ranks this process starts
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="xlserve-ranks-"), "rendezvous")


def start_ranks(config: EngineConfig, init_method: str, ranks) -> list[subprocess.Popen]:
    """Ranks other than 0 as processes of this machine, each told its place on its stdin."""
    procs = []
    for rank in ranks:
        spec = RankSpec(engine=flat_options(config), rank=rank, size=config.parallel.world_size,
                        init_method=init_method)
        # SIGKILL when the worker dies: it reaches a stopped rank too, and a rank keeps nothing to save
        proc = subprocess.Popen([sys.executable, "-m", "xlserve.parallel.follower"], stdin=subprocess.PIPE,
                                preexec_fn=functools.partial(die_with_parent, signal.SIGKILL))
        proc.stdin.write(spec.model_dump_json().encode())
        proc.stdin.close()
        procs.append(proc)
    log.info("started ranks %s (pids %s)", list(ranks), [p.pid for p in procs])
    return procs


def host_node(config: EngineConfig) -> int:
    """``xlserve worker --node-rank N`` (N > 0): this node's ranks, until they exit; their first
    non-zero exit code, or 0."""
    p = config.parallel
    per_node = p.world_size // p.nnodes
    procs = start_ranks(config, rendezvous(config), range(p.node_rank * per_node, (p.node_rank + 1) * per_node))
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return next((c for c in codes if c), 0)


class WorkerRanks(KVShards):
    """Rank 0's side: starts ranks 1..size-1, joins them, broadcasts plans, stops them."""

    def __init__(self, config: EngineConfig):
        p = config.parallel
        self.init_method = init_method = rendezvous(config)
        self.timeout = datetime.timedelta(seconds=p.distributed_timeout)
        self.procs = start_ranks(config, init_method, range(1, p.world_size // p.nnodes))
        try:
            self.plan_group = join(init_method, 0, config)
        except BaseException:
            self._kill()
            leave()
            raise
        self.tp = tensor_parallel.current()
        self.rank = 0
        self.size = p.world_size
        self.stage_slots: list[list[int]] = []  # each stage's KV layer slots: set by the engine once it knows them
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_cuda(config) else torch.device("cpu")

    def broadcast(self, plan: RankPlan) -> None:
        with out_of_step():
            send_plan(plan, self.plan_group, self.timeout)

    def send_step(self, output, path: DecodePath, cpu_kernels: bool) -> None:
        self.broadcast(RankPlan.of(output, path, cpu_kernels))

    def gather(self, block_ids: list[int], local: torch.Tensor, layout) -> torch.Tensor:
        """Each rank's slots and heads, sent to rank 0 point to point (stages hold different slots)."""
        import torch.distributed as dist
        self.broadcast(RankPlan(kind=PlanKind.KV_EXPORT, block_ids=block_ids))
        full = local.new_empty(len(block_ids), layout.num_layers, layout.parts, layout.block_size,
                               layout.num_kv_heads, layout.head_dim)
        heads = local.shape[-2]
        for rank in range(self.size):
            slots = self.stage_slots[rank // self.tp.size]
            part = local
            if rank:
                part = local.new_empty(len(block_ids), len(slots), *local.shape[2:])
                with out_of_step():
                    dist.recv(as_bytes(part), rank)  # a view: fills ``part``
            first = 0 if heads == layout.num_kv_heads else rank % self.tp.size * heads
            full[:, slots, ..., first:first + heads, :] = part
        return full

    def scatter(self, block_ids: list[int], full: torch.Tensor) -> None:
        import torch.distributed as dist
        self.broadcast(RankPlan(kind=PlanKind.KV_IMPORT, block_ids=block_ids, kv_heads=full.shape[-2]))
        with out_of_step():
            dist.broadcast(as_bytes(full), 0)

    def gather_from(self, rank: int, block_ids: list[int], layout) -> torch.Tensor:
        """These blocks of ``rank``'s own pool (data-parallel attention), whole, point to point."""
        import torch.distributed as dist

        from xlserve.engine.kv_blocks import DTYPES
        self.broadcast(RankPlan(kind=PlanKind.KV_EXPORT, block_ids=block_ids, only_rank=rank))
        blocks = torch.empty(len(block_ids), layout.num_layers, layout.parts, layout.block_size, layout.num_kv_heads,
                             layout.head_dim, dtype=DTYPES[layout.dtype], device=self.device)
        with out_of_step():
            dist.recv(as_bytes(blocks), rank)  # a view: fills ``blocks``
        return blocks

    def scatter_to(self, rank: int, block_ids: list[int], full: torch.Tensor) -> None:
        """``rank`` writes ``full`` (every slot and head) into these blocks of its own pool."""
        import torch.distributed as dist
        self.broadcast(RankPlan(kind=PlanKind.KV_IMPORT, block_ids=block_ids, kv_heads=full.shape[-2],
                                only_rank=rank))
        with out_of_step():
            dist.send(as_bytes(full), rank)

    def check_layout(self, layout) -> None:
        """Each slot must live on one stage. Windowed layer groups share slot numbers, so two
        stages may both hold slot j (of different groups' layers): which one a block's slot is
        on depends on the block's group, which the hand-off does not carry."""
        if sum(len(s) for s in self.stage_slots) != layout.num_layers:
            raise ValueError("the KV hand-off of a pipeline-parallel worker needs a model without windowed layers; "
                             "serve this one with --pipeline-parallel-size 1 on the side that exchanges KV")

    def check(self) -> None:
        """Raise ``EngineFatal`` when another rank has exited (the worker cannot go on without it)."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise EngineFatal(f"rank {rank} (pid {p.pid}) {exit_cause(p.returncode)}")

    def close(self, timeout: float = 30.0) -> None:
        """Stop every rank (they leave their loop on the stop plan) and leave the group."""
        try:
            if all(p.poll() is None for p in self.procs):  # else the rest cannot hear it: killed below
                self.broadcast(RankPlan(kind=PlanKind.STOP))
                for p in self.procs:
                    p.wait(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a rank that cannot be told is killed below
            log.warning("ranks did not stop cleanly: %s", e)
        finally:
            self._kill()
            leave()
            if self.init_method.startswith("file://"):
                shutil.rmtree(os.path.dirname(self.init_method.removeprefix("file://")), ignore_errors=True)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class OtherRankPool(KVShards):
    """Data-parallel attention: rank ``rank``'s own KV pool, as rank 0 reaches it (every head and
    slot of a block is there; none of it here)."""
    local = False

    def __init__(self, ranks: WorkerRanks, rank: int):
        self.ranks, self.owner, self.rank = ranks, rank, 0

    def gather(self, block_ids: list[int], local, layout) -> torch.Tensor:
        return self.ranks.gather_from(self.owner, block_ids, layout)

    def scatter(self, block_ids: list[int], full: torch.Tensor) -> None:
        self.ranks.scatter_to(self.owner, block_ids, full)

    def check_layout(self, layout) -> None:
        """Any layout: the rank holds every layer and head of its blocks."""
