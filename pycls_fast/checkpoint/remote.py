"""A remote OUT_DIR (an fsspec URL such as `s3://bucket/runs/vit`), worked on through a
local mirror folder.

Training writes logs, stats and checkpoints to the mirror as to any OUT_DIR; this
module brings them to the remote store and back:
- `pull_on_each_node(remote, timeout_s)` before the run: on each node whose mirror
  is its own, `pull()`: every file but the checkpoints, then the newest complete
  checkpoint (and the best one that `best.json` names): a file whole, a sharded one
  its `.metadata` only, so that the run can choose where to resume and its logs
  continue; the ranks wait for each other without the collective timeout;
- `fetch_checkpoint(remote, name, needed, timeout_s)` at the resume, once the model
  is built: the files of a sharded checkpoint that this node's ranks read (DCP's load
  plan of each rank: `sharded.files_to_read`), each downloaded once per node, several
  at a time;
- `push_checkpoint(path)` after each save: the logs go up first, so that a checkpoint
  on the store always has the logs up to it; a single-file checkpoint is one upload (an
  object store makes it visible whole or not at all); a sharded (DCP) directory is
  uploaded file by file with `.metadata` last, by which readers know it complete.
  Then the retention rule (TRAIN.CHECKPOINT_KEEP, the best kept) is applied to the
  remote listing;
- `push()` at each epoch's end and when the run ends: the other files that changed.
An object store has no atomic rename, so these guarantees replace it: a checkpoint is
never seen half-written; logs on the store lag the mirror by at most an epoch.
"""

import hashlib
import logging
import os
import posixpath
import socket
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor

from pycls_fast import storage
from pycls_fast.checkpoint.files import SHARDED_SUFFIX, SUFFIX, position
from pycls_fast.checkpoint.retention import BEST_FILE, read_best, to_delete
from pycls_fast.runtime import distributed
from pycls_fast.runtime.run_lock import RunLock

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
# A job's marker in rank 0's folder, by which other nodes tell whether they share it.
PULLED_MARKER = ".pulled_"
# What stays in the mirror: the lock, write probes, the local index cache, markers.
_LOCAL_ONLY = (".lock", ".write_test", "data_index/", PULLED_MARKER)
# Downloads in flight at once per rank (one stream each).
DOWNLOADS = 8


def mirror_dir(url: str, base: str = "") -> str:
    """The local mirror folder of `url`: `base` (OUT_MIRROR) or a folder under the
    system's temporary folder, named by the URL's hash."""
    if base:
        return base
    key = hashlib.sha1(url.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "pycls_fast_out", key)


class RemoteOut:
    """The remote OUT_DIR `url` and its local mirror `local`."""

    def __init__(self, url: str, local: str, keep_last: int = 0) -> None:
        self.url = url.rstrip("/")
        self.local = local
        self.keep_last = keep_last
        self.fs, self.root = storage.filesystem(self.url)
        self._pushed = {}  # relative path -> (size, mtime_ns) last uploaded
        self.fetched = []  # checkpoint names that pull() brought into the mirror

    def _remote(self, rel):
        return posixpath.join(self.root, rel)

    def _rel(self, remote_path):
        return posixpath.relpath(remote_path, self.root)

    def _download(self, rel):
        dest = os.path.join(self.local, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        # Under a temporary name, renamed when whole: another rank (of this node
        # or of one sharing the mirror) may be reading the same file.
        tmp = f"{dest}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            self.fs.get_file(self._remote(rel), tmp)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        st = os.stat(dest)
        self._pushed[rel] = (st.st_size, st.st_mtime_ns)

    def remote_checkpoints(self) -> list[str]:
        """Names of the complete checkpoints on the store, oldest first."""
        folder = self._remote(CHECKPOINTS)
        if not self.fs.exists(folder):
            return []
        found = []
        for entry in self.fs.ls(folder, detail=True):
            name = posixpath.basename(entry["name"].rstrip("/"))
            pos = position(name)
            if pos is None:
                continue
            whole_file = name.endswith(SUFFIX) and entry["type"] == "file"
            if whole_file or (
                name.endswith(SHARDED_SUFFIX)
                and self.fs.exists(posixpath.join(folder, name, ".metadata"))
            ):
                found.append((pos, name))
        return [name for _, name in sorted(found)]

    def pull(self) -> str | None:
        """Fills the mirror from the store (before logging is set up: `fetched` says
        what came); returns the newest complete checkpoint's name, or None. A
        sharded checkpoint comes as its `.metadata` only: each rank's files follow
        at the resume (`fetch_checkpoint`), those it reads."""
        os.makedirs(self.local, exist_ok=True)
        if not self.fs.exists(self.root):
            return None
        for path in self.fs.find(self.root):
            rel = self._rel(path)
            if not rel.startswith(CHECKPOINTS + "/") or rel.endswith(BEST_FILE):
                self._download(rel)
        names = self.remote_checkpoints()
        best = read_best_name(os.path.join(self.local, CHECKPOINTS, BEST_FILE))
        wanted = ([names[-1]] if names else []) + ([best] if best in names else [])
        for name in dict.fromkeys(wanted):
            rel = posixpath.join(CHECKPOINTS, name)
            self._download(posixpath.join(rel, ".metadata") if _sharded(name) else rel)
            self.fetched.append(name)
        return names[-1] if names else None

    def download(self, rels: list[str], threads: int = DOWNLOADS) -> None:
        """Downloads the files `rels` (relative to the OUT_DIR), several at a time."""
        if not rels:
            return
        with ThreadPoolExecutor(min(threads, len(rels))) as pool:
            list(pool.map(self._download, rels))

    def _changed(self):
        for folder, _, names in os.walk(self.local):
            for name in names:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                if rel.startswith(CHECKPOINTS + "/") and position(rel.split("/")[1]):
                    continue  # checkpoints go up through push_checkpoint
                if any(rel.startswith(p) for p in _LOCAL_ONLY) or ".tmp" in name:
                    continue
                st = os.stat(path)
                if self._pushed.get(rel) != (st.st_size, st.st_mtime_ns):
                    yield rel, (st.st_size, st.st_mtime_ns)

    def push(self) -> int:
        """Uploads the files other than checkpoints that changed; returns how many."""
        count = 0
        for rel, stamp in list(self._changed()):
            self.fs.put_file(os.path.join(self.local, rel), self._remote(rel))
            self._pushed[rel] = stamp
            count += 1
        return count

    def push_checkpoint(self, path: str, rank: int = 0, main: bool = True) -> None:
        """Uploads the checkpoint at `path` (in the mirror). A sharded directory: each
        rank uploads the `__<rank>_*` files it wrote, the main rank the rest but
        `.metadata`; the caller then calls `finish_checkpoint` on the main rank after
        a barrier. A file: the main rank uploads it (and finishes)."""
        name = os.path.basename(path)
        rel = posixpath.join(CHECKPOINTS, name)
        if not name.endswith(SHARDED_SUFFIX):
            if main:
                self.push()  # the logs first: a visible checkpoint has its logs
                self.fs.put_file(path, self._remote(rel))
                self._after_upload(name)
            return
        for file in sorted(os.listdir(path)):
            mine = file.startswith(f"__{rank}_")
            other_rank = file.startswith("__") and not mine
            if file == ".metadata" or other_rank or (not mine and not main):
                continue
            self.fs.put_file(os.path.join(path, file), self._remote(f"{rel}/{file}"))

    def finish_checkpoint(self, path: str) -> None:
        """The main rank, once every part of the sharded checkpoint `path` is up: the
        logs and best.json, then its `.metadata` (which makes it complete), then
        retention."""
        name = os.path.basename(path)
        self.push()  # the logs first: a complete checkpoint has its logs
        meta = posixpath.join(CHECKPOINTS, name, ".metadata")
        self.fs.put_file(os.path.join(path, ".metadata"), self._remote(meta))
        self._after_upload(name)

    def _after_upload(self, name):
        logger.info("uploaded checkpoint %s to %s", name, self.url)
        best = read_best(self.local)
        protected = {best["checkpoint"]} if best else set()
        remote = self.remote_checkpoints()
        for old in to_delete(remote, self.keep_last, protected):
            self.fs.rm(self._remote(posixpath.join(CHECKPOINTS, old)), recursive=True)
            logger.info("deleted old checkpoint %s from %s", old, self.url)


def _sharded(name: str) -> bool:
    return name.endswith(SHARDED_SUFFIX)


def sees_main_folder(folder: str) -> bool:
    """Every rank: whether this rank sees rank 0's `folder` (the same folder, or one
    on a file system shared with it) rather than a node-local one of its own; True
    on rank 0. A marker rank 0 leaves there for the others to look for."""
    if distributed.world_size() == 1:
        return True
    token = distributed.broadcast_object(uuid.uuid4().hex)
    marker = os.path.join(folder, f"{PULLED_MARKER}{token}")
    if distributed.is_main():
        os.makedirs(folder, exist_ok=True)
        open(marker, "w").close()  # noqa: SIM115 - an empty marker
    distributed.barrier()
    seen = os.path.exists(marker)
    distributed.barrier()  # every rank looked
    if distributed.is_main():
        os.remove(marker)
    return seen


def pull_on_each_node(remote: RemoteOut, timeout_s: float) -> None:
    """Every rank: fills the mirror of every node from the store, once per mirror
    folder: rank 0 pulls first, then the first rank of each node that does not share
    rank 0's mirror (a node-local one) pulls its own. The others wait for them
    without the collective timeout (DIST.TIMEOUT_S: a pull may take longer), for
    at most `timeout_s` (DIST.PULL_TIMEOUT_S)."""
    os.makedirs(remote.local, exist_ok=True)
    group = distributed.patient_group(timeout_s)
    if distributed.is_main():
        _pull(remote)
    distributed.wait_for_all(group, "rank 0's pull of OUT_DIR")
    own_mirror = not sees_main_folder(remote.local)
    if own_mirror and distributed.local_rank() == 0:
        _pull(remote)
    distributed.wait_for_all(group, "each node's pull of OUT_DIR")


def _pull(remote):
    with RunLock(remote.local):  # two runs on one node do not fill one mirror
        remote.pull()


def fetch_checkpoint(
    remote: RemoteOut, name: str, needed: set[str], timeout_s: float
) -> int:
    """Every rank, at the resume from the sharded checkpoint `name`: brings into
    this node's mirror the files of it that this rank reads (`needed`, names in the
    checkpoint's folder) and lacks. The ranks that share a mirror folder split their
    missing files, each downloaded once, several at a time; every rank then waits
    for all, without the collective timeout, for at most `timeout_s`
    (DIST.PULL_TIMEOUT_S). Returns how many files this rank downloaded."""
    folder = os.path.join(remote.local, CHECKPOINTS, name)
    missing = sorted(f for f in needed if not os.path.exists(os.path.join(folder, f)))
    where = (socket.gethostname(), os.path.realpath(remote.local))
    everyone = distributed.all_gather_object((where, missing))
    group = distributed.patient_group(timeout_s)
    mates = [r for r, (w, _) in enumerate(everyone) if w == where]
    wanted = sorted({f for r in mates for f in everyone[r][1]})
    # Round robin over the ranks of the folder: each file once, all at a time.
    me = distributed.rank()
    mine = [f for i, f in enumerate(wanted) if mates[i % len(mates)] == me]
    remote.download([posixpath.join(CHECKPOINTS, name, f) for f in mine])
    distributed.wait_for_all(group, f"the download of checkpoint {name}")
    return len(mine)


def read_best_name(path: str) -> str | None:
    """The checkpoint name in a best.json file, or None."""
    import json

    try:
        with open(path) as f:
            return json.load(f)["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
