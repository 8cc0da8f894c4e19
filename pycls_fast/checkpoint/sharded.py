"""Sharded checkpoints of FSDP runs, with torch.distributed.checkpoint (DCP).

A sharded checkpoint is a directory, `OUT_DIR/checkpoints/model_epoch_0003.dcp/`:
every rank writes its own shards of the model, EMA and optimizer state in parallel,
plus its RNG states; `.metadata` says where each piece lives, so the checkpoint loads
at any world size (DCP reshards on load). It is written to `<name>.tmp` and renamed
by rank 0 once every rank has finished, so a crash mid-write never leaves a directory
that looks complete.

    save(path, model, optimizer, ema, meta, rank_state)   # every rank
    future = start_save(path, ...); ...; publish(path)    # asynchronous (every rank)
    meta, rank_state = load(path, model, optimizer, ema)  # every rank
    files_to_read(path, model, optimizer, ema)            # what load reads here
    read_model_state(path, key="model")                   # one process, no group
    CheckpointTensors(path, key="model")                  # the same, read per tensor
    consolidate(path, out_file)                           # one single-file checkpoint
"""

import io
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pycls_fast.checkpoint.files import SHARDED_SUFFIX as SUFFIX
from pycls_fast.checkpoint.files import (
    is_sharded,
    safe_load,
    save_atomically,
    sync_folder,
)
from pycls_fast.errors import CheckpointError
from pycls_fast.parallel.tensor_parallel import to_checkpoint, tp_size
from pycls_fast.runtime import distributed

__all__ = [
    "SUFFIX",
    "CheckpointTensors",
    "is_sharded",
    "save",
    "start_save",
    "publish",
    "load",
    "read_meta",
    "read_model_state",
    "files_to_read",
]


def _blob(obj):
    # One opaque value (DCP would flatten a dict into its leaves): a BytesIO holding
    # the object, which DCP saves as it is and hands back on load.
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unblob(buf, path):
    buf.seek(0)
    return safe_load(buf, path)


# The optimizer's state keyed by parameter name, its hyper-parameters too
# ("param_groups.<name>.lr"): the same keys whatever the grouping, and tensor
# parallelism splits groups by tensor kind (components/optimizer.py).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _optim_options(saved):
    """The options that read the optimizer state of a checkpoint: flattened, or
    (checkpoints written before flattening) grouped as the optimizer was."""
    grouped = any(k.startswith("optim.param_groups.0.") for k in saved)
    return StateDictOptions() if grouped else _FLAT


def _full_metadata(path):
    return dcp.FileSystemReader(path).read_metadata()


def _read_metadata(path):
    return _full_metadata(path).state_dict_metadata


class _KnownMetadataReader(dcp.FileSystemReader):
    """A FileSystemReader of a checkpoint whose `.metadata` was read already: DCP
    asks for it at every `dcp.load`, and a reader of one tensor at a time would
    read and unpickle the whole index (hundreds of MB for ViT-22B on 512 ranks)
    once per tensor."""

    def __init__(self, path: str, metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def state_to_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module | None
) -> dict[str, Any]:
    """The tensors of a sharded checkpoint, as DCP saves them: "model", "optim"
    (keyed by parameter name) and "ema" state dicts of this rank's shards."""
    tp = tp_size(model)
    state = {
        "model": to_checkpoint(get_model_state_dict(model), tp),
        "optim": to_checkpoint(
            get_optimizer_state_dict(model, optimizer, options=_FLAT), tp
        ),
    }
    if ema is not None:
        state["ema"] = to_checkpoint(get_model_state_dict(ema), tp)
    return state


def _state(model, optimizer, ema, meta, rank_state):
    state = state_to_save(model, optimizer, ema)
    state["extra"] = {
        "meta": _blob({**meta, "world_size": distributed.world_size()}),
        f"rank_{distributed.rank()}": _blob(rank_state),
    }
    return state


def _clear_tmp(path):
    tmp = path + ".tmp"
    if distributed.local_rank() == 0 and os.path.exists(tmp):
        # A leftover of a write that crashed (each node's, when the folder is
        # node-local; on a shared one several nodes may race to remove it).
        shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier()
    return tmp


def publish(path: str) -> None:
    """Every rank, once its part of `<path>.tmp` is written: rank 0 renames it to
    `path` (replacing an older one of that name) when all ranks are done."""
    tmp = path + ".tmp"
    distributed.barrier()  # every rank's shards and the metadata are on disk
    # A node whose folder rank 0 does not share (the node-local mirror of a remote
    # OUT_DIR) does not see rank 0's .metadata: its first rank renames its own copy,
    # which holds its ranks' shards, so that they can upload them from `path`.
    own_copy = (
        not distributed.is_main()
        and distributed.local_rank() == 0
        and not os.path.exists(os.path.join(tmp, ".metadata"))
    )
    distributed.barrier()  # every node looked before rank 0 renames
    if distributed.is_main() or own_copy:
        _replace(tmp, path)
    distributed.barrier()


def _replace(tmp: str, path: str) -> None:
    """Renames the written folder `tmp` to `path`, over an older one (DCP synced
    the files; the parent folder's entries are synced after the rename)."""
    if os.path.exists(path):
        old = path + ".old"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)
    sync_folder(os.path.dirname(os.path.abspath(path)))


def save(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: nn.Module | None,
    meta: dict[str, Any],
    rank_state: Any,
) -> None:
    """Writes the sharded checkpoint `path` (a directory) from every rank.

    `meta`: values common to all ranks (rank 0's copy is kept); `rank_state`: this
    rank's own state (RNG states); both tensors and plain values only (they are
    loaded with weights_only)."""
    tmp = _clear_tmp(path)
    state = _state(model, optimizer, ema, meta, rank_state)
    dcp.save(state, checkpoint_id=tmp, planner=_save_planner())
    publish(path)


def start_save(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: nn.Module | None,
    meta: dict[str, Any],
    rank_state: Any,
    process_group=None,
    stager=None,
):
    """Every rank: stages its part of the checkpoint `path` to host memory and
    starts writing it to `<path>.tmp` in the background (DCP's async_save, its
    collectives on `process_group`, a gloo group of its own); returns the future.
    `publish(path)` makes it complete once the future is done on every rank."""
    tmp = _clear_tmp(path)
    state = _state(model, optimizer, ema, meta, rank_state)
    return dcp.async_save(
        state,
        checkpoint_id=tmp,
        process_group=process_group,
        async_stager=stager,
        planner=_save_planner(),
    )


def _save_planner():
    """DCP's planner, each value that several ranks hold (the meta, step counts,
    tensors replicated over data- or tensor-parallel ranks) written by the lowest
    of them: a rank resuming at the same layout then reads its own file and
    rank 0's (fetch_checkpoint pulls a node only those), not values spread over
    every rank's file."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def _check_fits(path, saved, prefix, state):
    """Names the first tensor of `state` that the checkpoint lacks or shapes
    differently (before DCP's own, less readable, error)."""
    for key, value in state.items():
        entry = saved.get(f"{prefix}.{key}")
        if entry is None:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: it lacks {key}"
            )
        if hasattr(entry, "size") and tuple(entry.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: it has {key} of shape "
                f"{tuple(entry.size)}, the model expects {tuple(value.shape)}"
            )


def _load_state(path, saved, model, optimizer, ema):
    """(whole, state, optimizer options) of a load: `state` holds the tensors DCP
    loads into (q/k/v pieces of tensor-parallel parameters as views of their local
    tensors), `whole` the state dicts to set from them."""
    tp = tp_size(model)
    whole = {"model": get_model_state_dict(model)}
    _check_fits(path, saved, "model", whole["model"])
    options = _optim_options(saved)
    whole["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    if ema is not None and any(k.startswith("ema.") for k in saved):
        whole["ema"] = get_model_state_dict(ema)
    return whole, {k: to_checkpoint(v, tp) for k, v in whole.items()}, options


def files_to_read(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: nn.Module | None,
) -> set[str]:
    """The files of the sharded checkpoint `path` that `load` reads on this rank
    (DCP's load plan of its shards against `.metadata`, which is all it needs of
    `path`), `.metadata` included: what a node-local mirror must hold to resume."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    metadata = _full_metadata(path)
    saved = metadata.state_dict_metadata
    _, state, _ = _load_state(path, saved, model, optimizer, ema)
    rank_key = f"rank_{distributed.rank()}"
    state["extra"] = {"meta": io.BytesIO()}
    if f"extra.{rank_key}" in saved:
        state["extra"][rank_key] = io.BytesIO()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    storage = metadata.storage_data
    plan = planner.create_local_plan()
    return {".metadata"} | {storage[i.storage_index].relative_path for i in plan.items}


def load(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: nn.Module | None,
) -> tuple[dict[str, Any], Any]:
    """Loads a sharded checkpoint into the (sharded) model, optimizer and EMA of
    every rank; returns (meta, rank_state), rank_state None when the checkpoint was
    written at another world size (the RNG streams of the ranks then start afresh)."""
    reader = _KnownMetadataReader(path, _full_metadata(path))
    saved = reader.read_metadata().state_dict_metadata
    whole, state, options = _load_state(path, saved, model, optimizer, ema)
    no_dist = not dist.is_initialized()
    meta = read_meta(path, no_dist=no_dist, reader=reader)
    rank_key = f"rank_{distributed.rank()}"
    same_world = meta.get("world_size") == distributed.world_size()
    if same_world and f"extra.{rank_key}" in saved:
        state["extra"] = {rank_key: io.BytesIO()}
    dcp.load(state, storage_reader=reader, no_dist=no_dist)
    set_model_state_dict(model, whole["model"])
    set_optimizer_state_dict(model, optimizer, whole["optim"], options=options)
    if "ema" in whole:
        set_model_state_dict(ema, whole["ema"])
    own = state.get("extra", {}).get(rank_key)
    return meta, _unblob(own, path) if own is not None else None


def read_meta(path: str, no_dist: bool = True, reader=None) -> dict[str, Any]:
    """The `meta` of a sharded checkpoint (by default read by this process alone,
    with no process group needed). `reader`: a DCP storage reader of `path`."""
    state = {"extra": {"meta": io.BytesIO()}}
    if reader is None:
        dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    else:
        dcp.load(state, storage_reader=reader, no_dist=no_dist)
    return _unblob(state["extra"]["meta"], path)


class CheckpointTensors(Mapping):
    """The full tensors of the state `key` ('model' or 'ema') of a sharded
    checkpoint, each read from disk when asked for (CPU, its saved dtype): a
    reader holds one tensor at a time, never the whole model. One process, no
    process group needed. The checkpoint's `.metadata` is read once, here."""

    def __init__(self, path: str, key: str = "model", reader=None) -> None:
        """`reader`: another CheckpointTensors' `reader` of `path` (its index)."""
        prefix = key + "."
        self.path, self.key = path, key
        self.reader = reader or _KnownMetadataReader(path, _full_metadata(path))
        metadata = self.reader.read_metadata()
        self._entries = {
            name[len(prefix) :]: e
            for name, e in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and hasattr(e, "size")
        }

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, without reading it."""
        return tuple(self._entries[name].size)

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        t = torch.empty(tuple(e.size), dtype=e.properties.dtype)
        dcp.load({self.key: {name: t}}, storage_reader=self.reader, no_dist=True)
        return t

    def meta(self) -> dict[str, Any]:
        """The checkpoint's `meta` (as `read_meta`), without reading `.metadata`
        again."""
        return read_meta(self.path, reader=self.reader)

    def __contains__(self, name) -> bool:
        return name in self._entries  # without reading it (Mapping's would)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def read_model_state(path: str, key: str = "model") -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict `key` ('model' or 'ema') of a sharded
    checkpoint, as CPU tensors in their saved dtypes; {} when it has none. Runs in
    one process with no process group (tools/test_net.py, consolidation)."""
    saved = _read_metadata(path)
    prefix = key + "."
    state = {
        name[len(prefix) :]: torch.empty(tuple(e.size), dtype=e.properties.dtype)
        for name, e in saved.items()
        if name.startswith(prefix) and hasattr(e, "size")
    }
    if state:
        dcp.load({key: state}, checkpoint_id=path, no_dist=True)
    return state


def consolidate(path: str, out_file: str) -> dict[str, Any]:
    """Writes the model (and EMA) weights of a sharded checkpoint to one file that
    TEST.WEIGHTS, TRAIN.WEIGHTS and tools/convert_weights.py read; returns its meta."""
    meta = read_meta(path)
    out = {
        "model_state": read_model_state(path, "model"),
        "epoch": meta.get("epoch"),
        "iter": meta.get("iter"),
        "cfg": meta.get("cfg"),
    }
    ema = read_model_state(path, "ema")
    if ema:
        out["ema_state"] = ema
    save_atomically(out, out_file)
    return meta
