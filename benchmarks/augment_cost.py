"""CPU and GIL-held time per image of each recipe family's train transform, the PIL
path against the tensor path, and the cores per GPU they take (`make bench-augment`).

    python -m benchmarks.augment_cost            # 256 images, 5 + 3 rounds
    python -m benchmarks.augment_cost --images 512 --rounds 7 --json out.json

One decoding thread (where the loader runs the transform: one intra-op thread) does
each recipe's train work (read, decode, crop, flip, augment, write into the batch row)
on photo-like JPEGs with ImageNet's size distribution (`synthetic.imagenet_like_size`),
every variant in turn, round after round (`harness.interleave`), with the same draws
in every round. The recipe families: pycls's crop + flip (no augmentation: the direct
path), pycls's AutoAugment, DeiT's RandAugment (rand-m9-mstd0.5-inc1, bicubic), DeiT
III's 3-Augment with colour jitter 0.3, AugReg's RandAugment (rand-m15-n2-mmax15-p1.0,
bilinear); each with TRAIN.AUGMENT_BACKEND pil, tensor and device, where the
decoding thread only crops and flips and the augmentations' cost moves to the
training device: `device_costs` times them there per batch (`--device`, `--batch`).

CPU: the thread's CPU clock per image. GIL-held: loader_scaling's ReleasedTimer
(the file read, JPEG decode, crop copy and resize) extended with the calls of each
path whose work releases the GIL, timed in separate rounds: the tensor path's torch
and numpy calls, the PIL path's Pillow decodes, resizes, transforms, filters, point
tables and conversions (`AugmentReleasedTimer`); the rest of the thread's CPU time
holds the GIL. The rules favour the PIL path: its wrappers' Python is counted as
released, where the tensor path's tensor methods and indexing are counted as held.

Cores per GPU = images/s of the step x CPU s per image, for the steps measured on one
H100 (docs/PERFORMANCE.md, "First measurements on a GPU": ViT-B/16, batch 128).
`--ops` also times each op of DeiT's RandAugment on its own (where the time goes).
"""

import argparse
import importlib
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.harness import interleave, per_round_ratios
from benchmarks.loader_scaling import ReleasedTimer

# time_net's train img/s of ViT-B/16 (batch 128) per AMP mode on one H100
# (docs/PERFORMANCE.md, "First measurements on a GPU").
H100_STEP_IMG_PER_S = {"fp32": 1118, "O1": 2377, "O2": 2427, "O3": 2755}
BASELINE = "pycls crop + flip"
# recipe family -> TrainTransform keywords (the configs' values).
RECIPES = {
    BASELINE: {},
    "AutoAugment (pycls)": {"augment": "AutoAugment"},
    "DeiT RandAugment": {
        "augment": "rand-m9-mstd0.5-inc1",
        "augment_interpolation": "bicubic",
    },
    "DeiT III 3-Augment + jitter": {"three_augment": True, "color_jitter": 0.3},
    "AugReg RandAugment": {
        "augment": "rand-m15-n2-mmax15-p1.0",
        "augment_interpolation": "bilinear",
    },
}
BACKENDS = ("pil", "tensor", "device")


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.augment_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--root", default="/tmp/pycls_fast_bench_augment")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--im-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5, help="interleaved CPU rounds")
    p.add_argument("--gil-rounds", type=int, default=3, help="rounds with the timer")
    p.add_argument("--max-others", type=float, default=0.5,
                   help="repeat a call while other jobs took more cores")  # fmt: skip
    p.add_argument("--ops", action="store_true", help="also time each DeiT op")
    p.add_argument(
        "--device",
        default="",
        help="where TRAIN.AUGMENT_BACKEND device's policies are timed "
        "(default: cuda when there is one; 'none' skips them)",
    )
    p.add_argument("--batch", type=int, default=128,
                   help="images per batch for the device policies")  # fmt: skip
    p.add_argument("--json", default="", help="also write the figures here")
    return p


class _Timed:
    """A callable's stand-in that adds the seconds of each call to `timer.seconds`;
    a call made inside another timed one (Pillow's resize loading the image) is part
    of the outer one's time."""

    def __init__(self, real, timer):
        self.real, self.timer = real, timer

    def __call__(self, *args, **kwargs):
        self.timer.calls += 1
        if self.timer.depth:
            return self.real(*args, **kwargs)
        self.timer.depth = 1
        t0 = self.timer.clock()
        try:
            return self.real(*args, **kwargs)
        finally:
            self.timer.seconds += self.timer.clock() - t0
            self.timer.depth = 0


class _TimedNamespace:
    """A module's stand-in whose callables are _Timed (torch, numpy)."""

    def __init__(self, real, timer):
        self._real, self._timer, self._cache = real, timer, {}

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if not callable(value) or isinstance(value, type):
            return value
        if name not in self._cache:
            self._cache[name] = _Timed(value, self._timer)
        return self._cache[name]


class AugmentReleasedTimer(ReleasedTimer):
    """ReleasedTimer plus the calls of both augmentation paths that release the GIL.

    Tensor path: every `torch.*` call of the tensor modules and the tensor methods
    that compute (TENSOR_METHODS): their ATen loops run without the GIL (the calls'
    argument parsing is counted too); and pillow_buffers' Pillow calls (rotations,
    Gaussian blur: Pillow's C loops). Views, indexing and the numpy on per-line
    vectors and small tables are counted as held. PIL path:
    the Pillow methods whose C work runs in an ImagingSection (decode, resize,
    transform, filter, point, convert, transpose, histogram, copy), their Python
    wrappers included. Blends (`Image.blend`, so ImageEnhance), `Image.merge` and the
    PIL -> numpy copies hold the GIL.

    Each wrapped call costs the thread a little Python that holds the GIL; `calls`
    counts them, and `held_per_call` (`calibrate`) is that cost, to take off.
    """

    TARGETS = ReleasedTimer.TARGETS + (
        ("pycls_fast.datasets.images.pillow_buffers", "transform_into"),
        ("pycls_fast.datasets.images.pillow_buffers", "gaussian_blur_into"),
    )
    NAMESPACES = {
        "pycls_fast.datasets.images.pillow_buffers": ("torch",),
        "pycls_fast.datasets.images.pixel_ops": ("torch",),
        "pycls_fast.datasets.images.geometry_ops": ("torch",),
        "pycls_fast.datasets.images.policies": ("torch",),
        "pycls_fast.datasets.images.augment": ("torch",),
        "pycls_fast.datasets.images.transforms": ("torch",),
    }
    PIL_METHODS = ("load", "resize", "transform", "filter", "point", "convert",
                   "transpose", "draft", "histogram", "copy")  # fmt: skip
    TENSOR_METHODS = ("to", "add_", "sub_", "mul_", "div_", "clamp_", "floor_",
                      "addcmul_", "bitwise_and", "bitwise_not", "bitwise_xor_",
                      "bitwise_right_shift_", "copy_", "clone", "reshape",
                      "contiguous", "index_select", "sum", "repeat",
                      "flip")  # fmt: skip

    def __enter__(self):
        super().__enter__()
        self.depth = 0
        self.calls = 0
        import torch

        for attr in self.TENSOR_METHODS:
            real = getattr(torch.Tensor, attr)
            setattr(torch.Tensor, attr, _method(_Timed(real, self)))
            self._saved.append((torch.Tensor, attr, real))
        for name, attrs in self.NAMESPACES.items():
            module = importlib.import_module(name)
            for attr in attrs:
                real = getattr(module, attr)
                setattr(module, attr, _TimedNamespace(real, self))
                self._saved.append((module, attr, real))
        from PIL import Image, ImageFile

        for cls, attr in [(Image.Image, m) for m in self.PIL_METHODS] + [
            (ImageFile.ImageFile, "load")
        ]:
            real = cls.__dict__.get(attr)
            if real is not None:
                setattr(cls, attr, _method(_Timed(real, self)))
                self._saved.append((cls, attr, real))
        return self


def calibrate(timer: AugmentReleasedTimer, calls: int = 20000) -> float:
    """CPU seconds that one wrapped call holds the GIL for on top of the call itself
    (the wrapper's own Python), measured on calls of a no-op."""
    noop = _Timed(lambda: None, timer)
    released, cpu = timer.seconds, time.thread_time()
    for _ in range(calls):
        noop()
    held = (time.thread_time() - cpu) - (timer.seconds - released)
    timer.seconds = released
    return max(held, 0.0) / calls


def _method(timed):
    def method(self, *args, **kwargs):
        return timed(self, *args, **kwargs)

    return method


def _images(args):
    """The index of `--images` ImageNet-sized photo-like JPEGs (generated once)."""
    from pycls_fast.datasets.formats.index import scan_split
    from pycls_fast.datasets.formats.synthetic import make_image_folder

    per_class = min(64, args.images)
    classes = -(-args.images // per_class)
    stamp = os.path.join(args.root, f".complete_imagenet_{classes}x{per_class}")
    if not os.path.exists(stamp):
        print(f"generating {classes * per_class} ImageNet-sized JPEGs in {args.root}")
        make_image_folder(
            args.root, ("train",), classes, per_class, size="imagenet", seed=0
        )
        open(stamp, "w").close()
    return scan_split(os.path.join(args.root, "train"))


def _variants():
    """{name: (recipe, backend)}: the baseline once (no augmentation: the same direct
    path under every backend), every other recipe under each backend."""
    out = {BASELINE: (BASELINE, "tensor")}
    for recipe in RECIPES:
        if recipe != BASELINE:
            for backend in BACKENDS:
                out[f"{recipe} [{backend}]"] = (recipe, backend)
    return out


def _step(decoder, indices, record):
    """One pass over `indices`: thread CPU seconds, and released seconds while an
    AugmentReleasedTimer is active, appended to `record`."""
    out = np.empty(decoder.shape, dtype=np.uint8)
    timer = record.get("timer")

    def run():
        random.seed(0)  # the PIL path's timm draws: the same in every round
        released = timer.seconds if timer else 0.0
        calls = timer.calls if timer else 0
        cpu = time.thread_time()
        for i in indices:
            bad = decoder.load_into(int(i), 0, out)
            assert bad is None, bad
        cpu = time.thread_time() - cpu
        if timer:  # the wrappers' own held time, taken off
            cpu -= (timer.calls - calls) * record["held_per_call"]
        record["cpu"].append(cpu)
        record["released"].append((timer.seconds if timer else 0.0) - released)

    return run


def measure(args, index) -> dict:
    """Per variant: CPU and GIL-held ms per image (medians over rounds), and the CPU
    ratio to the baseline (median of per-round ratios). Runs in the calling thread."""
    import torch

    from pycls_fast.datasets.images.transforms import TrainTransform
    from pycls_fast.datasets.modes.batch import ImageDecoder

    indices = np.arange(min(args.images, len(index)))
    variants = _variants()
    decoders = {}
    for name, (recipe, backend) in variants.items():
        transform = TrainTransform(
            args.im_size, augment_backend=backend, **RECIPES[recipe]
        )
        decoders[name] = ImageDecoder(index, transform, args.im_size, seed=0)
    cpu_records = {name: {"cpu": [], "released": []} for name in variants}
    steps = {n: _step(decoders[n], indices, cpu_records[n]) for n in variants}
    device = torch.device("cpu")
    interleave(steps, device, args.rounds, 1, max_others=args.max_others)
    gil_records = {name: {"cpu": [], "released": []} for name in variants}
    # The thread's CPU clock, as the CPU figures: other jobs' preemption would add
    # wall time to the released calls.
    with AugmentReleasedTimer(time.thread_time) as timer:
        held_per_call = calibrate(timer)
        for record in gil_records.values():
            record.update(timer=timer, held_per_call=held_per_call)
        steps = {n: _step(decoders[n], indices, gil_records[n]) for n in variants}
        interleave(steps, device, args.gil_rounds, 1, warmup=0,
                   max_others=args.max_others)  # fmt: skip
    n = len(indices)
    base = cpu_records[BASELINE]["cpu"][-args.rounds :]
    results = {}
    for name, (recipe, backend) in variants.items():
        cpu = cpu_records[name]["cpu"][-args.rounds :]
        held = [
            c - r
            for c, r in zip(gil_records[name]["cpu"], gil_records[name]["released"])
        ][-args.gil_rounds :]
        cpu_ms = 1e3 * statistics.median(cpu) / n
        results[name] = {
            "recipe": recipe,
            "backend": backend,
            "cpu_ms": cpu_ms,
            "gil_ms": 1e3 * statistics.median(held) / n,
            "vs_baseline": statistics.median(per_round_ratios(cpu, base)),
            "cores_per_h100": {
                mode: rate * cpu_ms / 1e3 for mode, rate in H100_STEP_IMG_PER_S.items()
            },
        }
    return results


def op_costs(args, index) -> list[dict]:
    """CPU ms of each op of DeiT's RandAugment at its magnitude (9) on `--images`
    crops, and its expected share per image (2 layers, each op drawn 1 in 15 and
    applied with probability 0.5)."""
    import torch

    from pycls_fast.datasets.images import policies
    from pycls_fast.datasets.images.transforms import TrainTransform, make_augment
    from pycls_fast.datasets.modes.batch import ImageDecoder

    decoder = ImageDecoder(index, TrainTransform(args.im_size), args.im_size, seed=0)
    crops = [
        torch.from_numpy(decoder.load(i, 0)[0])
        for i in range(min(args.images, len(index)))
    ]
    deit = RECIPES["DeiT RandAugment"]
    policy = policies.from_timm(
        make_augment(deit["augment"], args.im_size, deit["augment_interpolation"])
    )
    rows = []
    for op in policy.ops:
        fixed = policies.TensorOp(
            op.name, 1.0, op.magnitude, 0.0, op.magnitude_max, op.hparams,
            op.resample, op.fill,
        )  # fmt: skip
        rng = random.Random(0)
        cpu = time.thread_time()
        for crop in crops:
            fixed(crop, rng)
        ms = 1e3 * (time.thread_time() - cpu) / len(crops)
        share = 2 * 0.5 / len(policy.ops)
        rows.append({"op": op.name, "ms": ms, "ms_per_image": share * ms})
    return sorted(rows, key=lambda r: -r["ms_per_image"])


def device_costs(args, index) -> list[dict]:
    """Per recipe with augmentations, those on a batch of `--batch` crops on
    `--device` (TRAIN.AUGMENT_BACKEND device): the training thread's CPU ms
    per batch (the draws and the kernel launches), the device's ms per batch (CUDA
    events; on a CPU the thread's own time), and the torch ops launched per batch;
    medians over `--rounds` batches, each with its own draws."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pycls_fast.datasets.images.transforms import TrainTransform
    from pycls_fast.datasets.modes.batch import ImageDecoder
    from pycls_fast.datasets.to_device.augment_policy import DeviceAugment

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    device = torch.device(args.device)
    decoder = ImageDecoder(index, TrainTransform(args.im_size), args.im_size, seed=0)
    crops = [decoder.load(i % len(index), 0)[0] for i in range(args.batch)]
    batch = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).to(device)
    rows = []
    for recipe, kw in RECIPES.items():
        if recipe == BASELINE:
            continue
        policy = DeviceAugment(
            kw.get("augment", ""),
            kw.get("augment_interpolation", "random"),
            kw.get("three_augment", False),
            kw.get("color_jitter", 0.0),
        )
        for r in range(2):  # warm-up: the kernels' first launches
            policy(batch, random.Random(r))
        with _Count() as count:
            policy(batch, random.Random(2))
        cpu_ms, device_ms = [], []
        for r in range(args.rounds):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in "se")
                start.record()
            t0 = time.thread_time()
            policy(batch, random.Random(100 + r))
            cpu_ms.append(1e3 * (time.thread_time() - t0))
            if device.type == "cuda":
                end.record()
                end.synchronize()
                device_ms.append(start.elapsed_time(end))
            else:
                device_ms.append(cpu_ms[-1])
        rows.append(
            {
                "recipe": recipe,
                "device": str(device),
                "batch": args.batch,
                "thread_cpu_ms": statistics.median(cpu_ms),
                "device_ms": statistics.median(device_ms),
                "ops_per_batch": count.ops,
            }
        )
    return rows


def _print(results, ops, device_rows=()):
    modes = list(H100_STEP_IMG_PER_S)
    cores = " | ".join(f"cores per H100, {m}" for m in modes)
    print(
        f"| recipe | path | CPU ms / image | vs crop + flip | GIL-held ms | {cores} |"
    )
    print("|---|---|---:|---:|---:|" + "---:|" * len(modes))
    for r in results.values():
        path = "both" if r["recipe"] == BASELINE else r["backend"]
        cores = " | ".join(f"{r['cores_per_h100'][m]:.1f}" for m in modes)
        print(
            f"| {r['recipe']} | {path} | {r['cpu_ms']:.2f} | {r['vs_baseline']:.2f}x | "
            f"{r['gil_ms']:.3f} | {cores} |"
        )
    if device_rows:
        print(
            "\n| recipe (TRAIN.AUGMENT_BACKEND device) | device | batch | training "
            "thread CPU ms / batch | device ms / batch | device ms / image | torch "
            "ops / batch |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in device_rows:
            print(
                f"| {r['recipe']} | {r['device']} | {r['batch']} | "
                f"{r['thread_cpu_ms']:.1f} | {r['device_ms']:.1f} | "
                f"{r['device_ms'] / r['batch']:.3f} | {r['ops_per_batch']} |"
            )
    if ops:
        print("\n| DeiT RandAugment op (m9, bicubic) | ms per call | ms per image |")
        print("|---|---:|---:|")
        for row in ops:
            print(f"| {row['op']} | {row['ms']:.3f} | {row['ms_per_image']:.3f} |")


def main() -> None:
    args = _parser().parse_args()
    import torch
    from PIL import __version__ as pillow_version
    from timm import __version__ as timm_version

    index = _images(args)
    sizes = np.array([_size(index, i) for i in range(min(args.images, len(index)))])
    print(
        f"{len(sizes)} JPEGs, mean {sizes[:, 0].mean():.0f}x{sizes[:, 1].mean():.0f} "
        f"px, {args.im_size} px crops; torch {torch.__version__}, Pillow "
        f"{pillow_version}, timm {timm_version}"
    )
    # A decoding thread, as the loader's (its torch ops on one intra-op thread).
    with ThreadPoolExecutor(1) as pool:
        results = pool.submit(measure, args, index).result()
        ops = pool.submit(op_costs, args, index).result() if args.ops else []
    if not args.device:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device_rows = device_costs(args, index) if args.device != "none" else []
    _print(results, ops, device_rows)
    if args.json:
        record = {"images": len(sizes), "mean_size": sizes.mean(0).tolist(),
                  "im_size": args.im_size, "results": results, "ops": ops,
                  "device_policies": device_rows,
                  "h100_step_img_per_s": H100_STEP_IMG_PER_S}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


def _size(index, i):
    from pycls_fast.datasets.images.decode import EncodedImage

    return EncodedImage(index.read(i)).size


if __name__ == "__main__":
    main()
