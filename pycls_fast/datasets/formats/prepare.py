"""ImageNet-1k from its official archives to the `<split>/<class>/<image>` layout.

- `ILSVRC2012_devkit_t12.tar.gz`: parsed by torchvision's own ImageNet helper
  (`parse_devkit_archive`: the class list and each validation image's WordNet id), its
  MD5 checked against the official one unless told otherwise.
- `ILSVRC2012_img_train.tar`: a tar of 1000 per-class tars. Each class is extracted
  from the inner tar as a stream into a hidden staging folder and renamed into place
  when complete; a rerun skips the classes already in place and redoes a half-done one.
- `ILSVRC2012_img_val.tar`: 50,000 flat images, each written under its class folder
  (a temporary name, then renamed), skipped when already there; `val/.complete` marks
  the split done.
Reading the outer train tar seeks from member to member (no extraction of the whole
archive first, so no second copy on disk).
"""

import contextlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from unittest import mock

from pycls_fast.errors import UserError

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"
DONE = ".complete"


def _archive(path: str) -> str:
    if not os.path.isfile(path):
        raise UserError(f"archive not found: {path}")
    return path


def parse_devkit(devkit: str, check_md5: bool = True) -> tuple[dict, list[str]]:
    """Returns ({wnid: class names}, [wnid of each validation image, in file-name
    order]) from the devkit archive, through torchvision's parser."""
    from torchvision.datasets import imagenet

    _archive(devkit)
    with tempfile.TemporaryDirectory() as tmp:
        # torchvision reads the archive by its official name in a root folder.
        os.symlink(os.path.abspath(devkit), os.path.join(tmp, DEVKIT))
        verify = (
            contextlib.nullcontext()
            if check_md5
            else mock.patch.object(imagenet, "_verify_archive", lambda *a: None)
        )
        try:
            with verify:
                imagenet.parse_devkit_archive(tmp, DEVKIT)
        except RuntimeError as e:  # torchvision's "not found or corrupted"
            raise UserError(
                f"{devkit}: its MD5 is not the official archive's ({e}); a partial "
                "download? (--no-md5 uses it anyway)"
            ) from None
        except (tarfile.TarError, OSError, KeyError, ValueError) as e:
            raise UserError(f"{devkit}: not an ImageNet devkit archive ({e})") from None
        wnid_to_classes, val_wnids = imagenet.load_meta_file(tmp)
    return wnid_to_classes, val_wnids


def _open_tar(path):
    try:
        return tarfile.open(_archive(path), "r:")
    except tarfile.TarError as e:
        raise UserError(f"{path}: not a tar archive ({e})") from None


def _is_image_name(name):
    return name.lower().endswith((".jpeg", ".jpg", ".png"))


def extract_train(
    train_tar: str, out: str, progress: Callable[[int, int], None] | None = None
) -> int:
    """Extracts the per-class tars of `train_tar` into `out/train/<wnid>/`; returns the
    number of classes extracted by this call (the others were already there)."""
    split = os.path.join(out, "train")
    os.makedirs(split, exist_ok=True)
    done = 0
    with _open_tar(train_tar) as outer:
        members = [m for m in outer.getmembers() if m.isfile()]
        if not members or not all(m.name.endswith(".tar") for m in members):
            raise UserError(f"{train_tar}: expected a tar of per-class .tar files")
        for k, member in enumerate(members):
            wnid = os.path.basename(member.name)[: -len(".tar")]
            final = os.path.join(split, wnid)
            if not os.path.isdir(final):
                staging = os.path.join(split, f".{wnid}.partial")
                shutil.rmtree(staging, ignore_errors=True)  # an interrupted class
                os.makedirs(staging)
                inner = outer.extractfile(member)
                with tarfile.open(fileobj=inner, mode="r|") as tar:
                    for m in tar:
                        if m.isfile() and _is_image_name(m.name):
                            dest = os.path.join(staging, os.path.basename(m.name))
                            with open(dest, "wb") as f:
                                shutil.copyfileobj(tar.extractfile(m), f)
                os.replace(staging, final)
                done += 1
            if progress is not None:
                progress(k + 1, len(members))
    return done


def extract_val(
    val_tar: str,
    out: str,
    val_wnids: list[str],
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Writes each image of `val_tar` to `out/val/<wnid>/`, the wnids given in file-name
    order (as the devkit lists them); returns the number of images written by this
    call (those already there are skipped)."""
    split = os.path.join(out, "val")
    if os.path.exists(os.path.join(split, DONE)):
        return 0
    with _open_tar(val_tar) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and _is_image_name(m.name)),
            key=lambda m: os.path.basename(m.name),
        )
        if len(members) != len(val_wnids):
            raise UserError(
                f"{val_tar} holds {len(members)} images, the devkit lists "
                f"{len(val_wnids)} validation labels: not the matching archives"
            )
        written = 0
        for k, (member, wnid) in enumerate(zip(members, val_wnids, strict=True)):
            folder = os.path.join(split, wnid)
            dest = os.path.join(folder, os.path.basename(member.name))
            if not os.path.exists(dest):
                os.makedirs(folder, exist_ok=True)
                tmp = f"{dest}.partial"
                with open(tmp, "wb") as f:
                    shutil.copyfileobj(tar.extractfile(member), f)
                os.replace(tmp, dest)
                written += 1
            if progress is not None and ((k + 1) % 500 == 0 or k + 1 == len(members)):
                progress(k + 1, len(members))
    open(os.path.join(split, DONE), "w").close()
    return written
