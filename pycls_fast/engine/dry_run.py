"""A dry run of one rank of an N-rank training job, on this machine, in about a minute.

    report = dry_run(cfg, rank=0)   # cfg.NUM_GPUS ranks; this process plays `rank`
    print(format_report(report))    # tools/plan_net.py --dry-run

"Will my 512-GPU job start, and fit?" This process joins torch's fake process group
(`torch.testing._internal.distributed.fake_pg`: every collective returns at once) as
rank r of NUM_GPUS and runs the real code of a training run under a FakeTensorMode
(tensors with shapes, dtypes and devices but no data, so a 22B model costs nothing):
the config checks, the (pp, dp, tp) mesh, the model built on the meta device, the
trainer's `build_components` (tensor and pipeline parallelism, FSDP, the EMA, the
optimizer), two training steps of this rank's share of the batch, and the
checkpoint's save plan (DCP's `DefaultSavePlanner`: what this rank would write).

Memory is counted as the tensors' bytes (`LiveBytes`): the state the rank keeps
(parameters, EMA, master weights, optimizer state after a first step) and the peak
of the second step above it (activations, gathered FSDP weights, gradients,
temporaries), next to parallel/planner.py's prediction for the same rank. Not
counted: the CUDA context and kernels' workspaces, the allocator's rounding and
fragmentation (the planner's HEADROOM), communication buffers of NCCL.

Simulated, not run: VIT.ATTENTION 'auto' is the kernel it resolves to on CUDA
(SDPA; on the CPU device type torch then runs its flash kernel, which keeps what
CUDA's flash kernel keeps: the output and the log-sum-exp, no attention matrix),
DDP's wrapper (its reducer needs real tensors; a DDP rank is run
as one process at its share of the batch: DDP's buckets are the gradients,
`gradient_as_bucket_view`), the device (the dry run uses the CPU device type: the
same tensors, without CUDA streams), and torch.compile (TRAIN.COMPILE is set to
off: the compiled code keeps the same tensors alive or fewer).
"""

import collections
import math
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves
from yacs.config import CfgNode

from pycls_fast.checkpoint.sharded import state_to_save
from pycls_fast.components.precision import (
    AmpMode,
    input_dtype,
    prepare_model,
    resolve_amp,
)
from pycls_fast.components.precision import autocast as amp_autocast
from pycls_fast.config import pp_microbatches, with_overrides
from pycls_fast.engine.model_setup import build_components
from pycls_fast.engine.step import train_step
from pycls_fast.errors import UserError
from pycls_fast.models import build_model
from pycls_fast.models.attention import resolve_kernel
from pycls_fast.parallel.data_parallel import fsdp_enabled, sharded_checkpoints
from pycls_fast.parallel.mesh import Layout
from pycls_fast.parallel.planner import GIB, HEADROOM, Candidate, rank_memory
from pycls_fast.runtime.distributed import local_tensor

# Whether this process ran a dry run already: a second one fails in torch's pipeline
# stages (some state of torch outlives the fake process group; not found yet), so it
# is refused in one line. tools/plan_net.py runs one per process.
_ran = [False]


@dataclass
class DryRunReport:
    """What one rank of the job holds and writes, measured and predicted (bytes)."""

    rank: int
    world: int
    layout: Layout
    coords: tuple[int, int, int]
    measured: dict[str, int]
    predicted: dict[str, int]
    checkpoint: dict[str, int]
    seconds: float
    notes: list[str] = field(default_factory=list)
    # Bytes live at the step's peak by the op that made them (dry_run(by_op=True)).
    peak_by_op: dict[str, int] = field(default_factory=dict)


def dry_run(cfg: CfgNode, rank: int = 0, by_op: bool = False) -> DryRunReport:
    """Builds and steps rank `rank` of a cfg.NUM_GPUS-rank job with fake tensors and
    a fake process group (module docstring). Must run in a process that has no
    process group yet, once per process; leaves no group behind. `by_op`: also
    the bytes live at the step's peak by the op that made them."""
    world = cfg.NUM_GPUS
    if not 0 <= rank < world:
        raise UserError(f"--rank {rank}: the job has ranks 0 to {world - 1}")
    if dist.is_initialized():
        raise UserError("the dry run needs a process without a process group")
    if _ran[0]:
        raise UserError("one dry run per process: start another for another rank")
    _ran[0] = True
    start = time.perf_counter()
    layout = Layout.from_cfg(cfg, world)
    coords = layout.coords(rank)
    notes = []
    run_cfg, run_rank, run_world = cfg, rank, world
    if layout.dp > 1 and not fsdp_enabled(cfg) and not layout.model_parallel:
        # DDP: one process at its share of the batch (module docstring).
        run_cfg = with_overrides(
            cfg, {"NUM_GPUS": 1, "TRAIN.BATCH_SIZE": cfg.TRAIN.BATCH_SIZE // world}
        )
        run_rank, run_world = 0, 1
        notes.append("DDP: run as one process at its share of the batch")
    overrides = {"TRAIN.COMPILE": "off", "TRAIN.CUDA_GRAPHS": False}
    if cfg.VIT.ATTENTION == "auto":
        # The kernel a GPU would run (SDPA: flash keeps no attention matrix), not
        # this CPU's measured choice.
        overrides["VIT.ATTENTION"] = resolve_kernel("auto", "cuda", resolve_amp(cfg)[1])
    run_cfg = with_overrides(run_cfg, overrides)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(
        "fake", store=FakeStore(), rank=run_rank, world_size=run_world
    )
    try:
        with _fake_mode(), warnings.catch_warnings():
            # Fake tensors have no data pointers (FSDP asks); the FSDP root's
            # returned-view warning is the real run's too.
            warnings.filterwarnings(
                "ignore", "Accessing the data pointer of FakeTensor"
            )
            warnings.filterwarnings("ignore", "FSDP2-wrapped module")
            measured, checkpoint, peak_by_op = _build_and_step(run_cfg, layout, by_op)
    finally:
        dist.destroy_process_group()
    c = Candidate(
        pp=layout.pp,
        dp=layout.dp,
        tp=layout.tp,
        fsdp=fsdp_enabled(cfg),
        checkpoint=cfg.FSDP.ACTIVATION_CHECKPOINT,
        micro=pp_microbatches(cfg) if layout.pp > 1 else 0,
    )
    predicted = rank_memory(cfg, c, coords[0])
    return DryRunReport(
        rank,
        world,
        layout,
        coords,
        measured,
        predicted,
        checkpoint,
        time.perf_counter() - start,
        notes,
        peak_by_op,
    )


def _build_and_step(cfg: CfgNode, layout: Layout, by_op: bool = False):
    """(measured bytes by part, the checkpoint plan, the peak's bytes by op) of
    this rank, under the fake mode and process group."""
    model = _meta_model(cfg)
    # The meta model's parameters become fake CPU tensors (no data, no memory);
    # the initialization is skipped (its values do not change memory).
    model.to_empty(device="cpu")
    parts = build_components(cfg, loaders=(), model=model)
    state = {
        "params": _bytes(parts.model.parameters()),
        "ema": _bytes(parts.ema.parameters()) if parts.ema is not None else 0,
        "master": _bytes(parts.master.master_params) if parts.master is not None else 0,
    }
    batch = cfg.TRAIN.BATCH_SIZE // layout.dp
    size = cfg.TRAIN.IM_SIZE
    dtype = input_dtype(parts.mode, parts.half_dtype)
    x = torch.empty(batch, 3, size, size, dtype=dtype)
    y = torch.zeros(batch, dtype=torch.long)
    if parts.pipeline is not None:
        parts.pipeline.set_static_shapes(_stage_shapes(cfg, parts, batch))
    _weak_tables()
    train_step(parts, x, y)  # the optimizer creates its state
    state["optimizer"] = _optimizer_bytes(parts.optimizer)
    tracker = LiveBytes(by_op)
    with tracker:
        train_step(parts, x, y)
    measured = {**state, "step": tracker.peak, "total": sum(state.values())}
    measured["total"] += tracker.peak
    # DTensor's shard arithmetic makes small index tensors: real ones (fake ones
    # would hide their values); the model's tensors stay fake.
    with unset_fake_temporarily():
        checkpoint = _checkpoint_plan(cfg, parts)
    return measured, checkpoint, tracker.peak_by_op


def _weak_tables() -> None:
    """Gives the active dry-run FakeTensorMode back its weak tables (see
    `_StrongIds`): once the model is built nothing swaps parameters, and the
    strong tables would keep every tensor they see alive (an activation the
    checkpointing frees would stay counted)."""
    from torch.utils.weak import WeakIdKeyDictionary

    converter = _active_fake_mode().fake_tensor_converter.meta_converter
    converter.tensor_memo = weakref.WeakValueDictionary()
    converter.describer.lookup_tensor = WeakIdKeyDictionary()


def _bytes(tensors) -> int:
    out = 0
    for t in tensors:
        t = local_tensor(t)
        out += t.numel() * t.element_size()
    return out


def _optimizer_bytes(optimizer) -> int:
    tensors = []
    for st in optimizer.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v) and v.ndim > 0]
    return _bytes(tensors)


def _meta_model(cfg: CfgNode):
    """The model on the meta device, built outside the fake mode: it draws its init
    seed from torch's real generator (models/vit.py `init_seed`), a value a fake
    tensor does not have."""
    with unset_fake_temporarily(), torch.device("meta"):
        return build_model(cfg)


def _stage_shapes(cfg: CfgNode, parts, batch: int):
    """Example tensors of a pipeline stage's input and output per stage index
    (static metadata: a fake process group carries no shapes between stages):
    images into the first stage, the token stream between stages (whole, also
    under sequence parallelism), logits out of the last. Computed by a meta copy
    of the model under the run's precision."""
    micro = batch // pp_microbatches(cfg)
    mode, half = resolve_amp(cfg)
    whole = _meta_model(cfg)
    whole.to_empty(device="cpu")  # fake tensors: no memory
    if not (fsdp_enabled(cfg) and mode is AmpMode.O2):
        prepare_model(whole, mode, half, cfg.AMP.LAYER_NORM_FP32)
    else:  # FSDP O2 gathers the weights in half precision
        whole.to(half)
    size = cfg.TRAIN.IM_SIZE
    images = torch.empty(micro, 3, size, size, dtype=input_dtype(mode, half))
    with amp_autocast("cpu", mode, half):
        tokens = whole.embed(images)
        logits = whole.classify(tokens)
    n_stages = parts.pipeline.n_stages

    def fake(t):
        return torch.empty(t.shape, dtype=t.dtype)

    def shapes(index: int):
        first, last = index == 0, index == n_stages - 1
        inputs = images if first else fake(tokens)
        outputs = fake(logits) if last else fake(tokens)
        return {
            "input_args": inputs,
            "output_args": outputs,
            "output_grads": None if last else fake(tokens),
            "input_grads": None if first else fake(tokens),
        }

    return shapes


def _checkpoint_plan(cfg: CfgNode, parts) -> dict[str, int]:
    """What this rank writes at a checkpoint: bytes and DCP write items of its
    local save plan (sharded layouts), or the whole file (rank 0, else nothing)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    if not sharded_checkpoints(cfg):
        if dist.get_rank() != 0:
            return {"bytes": 0, "items": 0}
        sd = {**parts.model.state_dict(), **_optimizer_tensors(parts.optimizer)}
        if parts.ema is not None:
            sd.update({f"ema.{k}": v for k, v in parts.ema.state_dict().items()})
        return {"bytes": _bytes(sd.values()), "items": len(sd)}
    state = state_to_save(parts.model, parts.optimizer, parts.ema)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=dist.get_rank() == 0)
    plan = planner.create_local_plan()
    total = 0
    for item in plan.items:
        if item.tensor_data is None:
            continue
        dtype = item.tensor_data.properties.dtype
        total += math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize
    return {"bytes": total, "items": len(plan.items)}


def _optimizer_tensors(optimizer):
    out = {}
    for i, st in enumerate(optimizer.state.values()):
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{k}"] = v
    return out


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors that ops create while it is active, until
    they are freed: `peak` is the most held at once (over what existed before).
    Storages are counted once (views share them); FSDP's storage resizes
    (`UntypedStorage.resize_`, invisible to dispatch) are followed. Real tensors
    work too (benchmarks/build_memory.py; meta ones hold nothing). The same
    accounting as torch's `MemTracker`, without its per-module snapshots."""

    def __init__(self, by_op: bool = False) -> None:
        """`by_op`: also keep `peak_by_op`, the bytes live at the peak by the op
        that made each tensor (`_op_label`)."""
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.by_op = by_op
        self.peak_by_op: dict[str, int] = {}
        self._op = REGROWN
        self._label_of: dict[int, str] = {}
        self._live_by_op: collections.Counter = collections.Counter()

    def _holds_memory(self, st: torch.UntypedStorage) -> bool:
        # Under the dry run's fake mode every storage is a meta one (a fake
        # tensor's); in a real run a meta storage holds no memory.
        return self._fake is not None or st.device.type != "meta"

    def _add(self, st: torch.UntypedStorage) -> None:
        if not self._holds_memory(st):
            return
        key = id(st)
        if key in self._sizes and self._refs[key]() is st:
            return
        n = st.nbytes()
        self._sizes[key] = n
        self._refs[key] = weakref.ref(st, lambda _, k=key: self._free(k))
        if self.by_op:
            self._label_of[key] = self._op
        self._grow(n, self._op)

    def _free(self, key: int) -> None:
        n = self._sizes.pop(key, 0)
        self.live -= n
        self._refs.pop(key, None)
        label = self._label_of.pop(key, None)
        if self.by_op and label is not None:
            self._live_by_op[label] -= n

    def _grow(self, n: int, label: str) -> None:
        self.live += n
        if self.by_op:
            self._live_by_op[label] += n
        if self.live > self.peak:
            self.peak = self.live
            if self.by_op:
                self.peak_by_op = {k: v for k, v in self._live_by_op.items() if v}

    def _resized(self, st: torch.UntypedStorage, before: int) -> None:
        if not self._holds_memory(st):
            return
        key = id(st)
        if key in self._sizes and self._refs[key]() is st:
            n = st.nbytes()
            self._grow(n - self._sizes[key], self._label_of.get(key, REGROWN))
            self._sizes[key] = n
        elif before == 0 and _active_fake_mode() is self._fake:
            # A storage made before the tracker and freed (FSDP's unsharded
            # parameters and gradients, resized to 0 after the last step) grows
            # back: new bytes of this step, until it is freed again.
            self._op = REGROWN
            self._add(st)

    def __enter__(self):
        self._fake = _active_fake_mode()
        self._orig_resize = torch.UntypedStorage.resize_
        orig = self._orig_resize

        @wraps(orig)
        def resize_(st, size):
            before = st.nbytes()
            out = orig(st, size)
            self._resized(st, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs its local ops, counted then
        if func is torch.ops._c10d_functional.wait_tensor.default:
            # Its fake kernel makes a new tensor; the real one returns its input.
            return args[0]
        if self.by_op:
            self._op = _op_label(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops under its own fake mode: not
        # memory of the run.
        if _active_fake_mode() is self._fake:
            # An in-place or out= op, or a view, returns an input's storage: no new
            # bytes (the optimizer's update of parameters made before the tracker).
            inputs = {id(st) for st in _storages(tree_leaves((args, kwargs)))}
            for st in _storages(tree_leaves(out)):
                if id(st) not in inputs:
                    self._add(st)
        return out


# format_report lists the ops that made at least this share of the step's peak.
PEAK_OP_MIN = 0.005

# The label of storages that FSDP regrows in place (`resize_`): its gathered
# parameters (and, without mixed precision, gradients), made before the tracker.
REGROWN = "resize_ (FSDP's gathered parameters)"


def _op_label(func, args, kwargs) -> str:
    """What made a tensor, for LiveBytes.peak_by_op: the aten op, with the
    dtypes of a cast (a weight's cast by autocast, a gradient's back to fp32)
    and the dimensions of its input, and whether autograd's backward ran it."""
    label = func.overloadpacket.__name__
    if label == "_to_copy" and args and isinstance(args[0], torch.Tensor):
        src, dst = args[0].dtype, kwargs.get("dtype") or args[0].dtype
        label += f" {args[0].dim()}-d {str(src)[6:]} -> {str(dst)[6:]}"
    if torch._C._current_graph_task_id() != -1:
        label += " (backward)"
    return label


def _storages(leaves) -> Iterator[torch.UntypedStorage]:
    """The storages that hold the tensors among `leaves`: a wrapper subclass's
    (torchao's float8 tensors) are its inner tensors' (a Float8TrainingTensor's
    nominal dtype is its high-precision one; its bytes are its float8 data's),
    which its own dispatch made where this mode does not see them."""
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            # Its tensor attributes, read directly: a subclass's own
            # __tensor_flatten__ may read values (torchao's weight wrapper tests
            # its scale), which fake tensors have none of.
            yield from _storages(vars(t).values())
        else:
            yield t.untyped_storage()


def _active_fake_mode():
    from torch._guards import active_fake_mode

    return active_fake_mode()


class _StrongIds:
    """A FakeTensorMode's tensor-id table without weak references: the module's
    `.to()` and `.float()` swap parameters (`torch.utils.swap_tensors`), which
    refuses tensors that have weak references, and FakeTensorMode's tables hold a
    weak reference to every parameter made in it."""

    def __init__(self) -> None:
        self.data: dict[int, tuple[torch.Tensor, int]] = {}

    def __contains__(self, t) -> bool:
        return id(t) in self.data

    def __getitem__(self, t):
        return self.data[id(t)][1]

    def __setitem__(self, t, v) -> None:
        self.data[id(t)] = (t, v)

    def get(self, t, default=None):
        entry = self.data.get(id(t))
        return default if entry is None else entry[1]

    def __deepcopy__(self, memo):
        return self  # the EMA's deepcopy of a fake model reaches the mode


class _Memo(dict):
    def __deepcopy__(self, memo):
        return self


@contextmanager
def _fake_mode() -> Iterator[None]:
    """A FakeTensorMode for the dry run: tensors made in it are fake; ops on real
    CPU tensors only (the device mesh's rank tables) run for real; device meshes
    are built from real rank tables."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
    from torch._subclasses.fake_tensor import (
        FakeTensor,
        FakeTensorMode,
        unset_fake_temporarily,
    )

    class DryRunMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [
                a for a in tree_leaves((args, kwargs or {})) if torch.is_tensor(a)
            ]
            if tensors and all(
                not isinstance(a, FakeTensor) and a.device.type == "cpu"
                for a in tensors
            ):
                with unset_fake_temporarily():
                    return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    orig_mesh = device_mesh.init_device_mesh

    @wraps(orig_mesh)
    def real_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return orig_mesh(*args, **kwargs)

    device_mesh.init_device_mesh = real_mesh
    fsdp_init.init_device_mesh = real_mesh
    # The fake kernels' results are cached per class: a cache of another run's
    # meshes and modules must not answer this one.
    FakeTensorMode.cache_clear()
    try:
        with DryRunMode(allow_non_fake_inputs=True) as mode:
            converter = mode.fake_tensor_converter.meta_converter
            converter.tensor_memo = _Memo()
            converter.describer.lookup_tensor = _StrongIds()
            yield
    finally:
        device_mesh.init_device_mesh = orig_mesh
        fsdp_init.init_device_mesh = orig_mesh


_MEASURED = ("params", "ema", "master", "optimizer")


def format_report(name: str, gpu_gib: float, r: DryRunReport) -> str:
    """The report as text: GiB by part, measured next to predicted."""
    pp, dp, tp = r.coords
    p = r.predicted
    lines = [
        f"{name}: dry run of rank {r.rank} of {r.world} "
        f"({r.layout.describe()}; this rank: pp {pp}, dp {dp}, tp {tp}) "
        f"in {r.seconds:.0f} s",
        "  GiB on this rank         measured  planner",
    ]
    for k in _MEASURED:
        lines.append(f"  {k:24s} {r.measured[k] / GIB:8.2f} {p[k] / GIB:8.2f}")
    step = p["grads"] + p["gathered"] + p["autocast"] + p["activations"]
    lines.append(
        f"  {'step peak':24s} {r.measured['step'] / GIB:8.2f} {step / GIB:8.2f}"
        "  (grads, gathered weights, autocast casts, activations)"
    )
    total, pred = r.measured["total"], p["total"]
    ratio = total / pred if pred else float("nan")
    lines.append(
        f"  {'total':24s} {total / GIB:8.2f} {pred / GIB:8.2f}"
        f"  (measured / planner {ratio:.2f})"
    )
    fits = total <= HEADROOM * gpu_gib * GIB
    lines.append(
        f"  fits in {HEADROOM:.0%} of {gpu_gib:.3g} GiB: {'yes' if fits else 'NO'}"
    )
    lines.append(
        f"  checkpoint: this rank writes {r.checkpoint['bytes'] / GIB:.2f} GiB "
        f"in {r.checkpoint['items']} items"
    )
    lines += [f"  note: {n}" for n in r.notes]
    if r.peak_by_op:
        lines.append("  GiB at the step's peak, by the op that made each tensor:")
        ranked = sorted(r.peak_by_op.items(), key=lambda kv: -kv[1])
        shown = [(k, v) for k, v in ranked if v >= PEAK_OP_MIN * r.measured["step"]]
        lines += [f"  {v / GIB:8.3f}  {k}" for k, v in shown]
        rest = sum(v for _, v in ranked) - sum(v for _, v in shown)
        lines.append(f"  {rest / GIB:8.3f}  ({len(ranked) - len(shown)} others)")
    return "\n".join(lines)
