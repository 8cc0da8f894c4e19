"""Image decoding: JPEGs straight into a reused buffer, Pillow for everything else.

The loader's threads spend most of an image's time in native code that releases the
GIL; what stays under the GIL (per-image Python) is what keeps two threads from
running at twice the speed of one, so the common case takes few Python steps:

- An RGB JPEG (3 components: ImageNet's images but a handful) has its size read from
  the header (`jpeg_rgb_size`, a few markers, no PIL object), and is decoded by
  Pillow's libjpeg-turbo decoder in one call that releases the GIL, into a per-thread
  RGBX buffer (`decode_jpeg_rgbx`): no fresh ~1 MB image per decode, no copy of it.
- Everything else (PNG, grayscale, CMYK, alpha, 16-bit) is opened by Pillow and
  converted to RGB (`to_rgb`).

For JPEGs, libjpeg's DCT scaling decodes at 1/2, 1/4 or 1/8 size when the crop stays
at least the output size (`draft_scale`): large images decode in a fraction of the
time and memory. The train crop is resized by torch's uint8 antialiased bilinear
kernel on the RGBX pixels (`resize_crop_into`: Pillow's BILINEAR filter, vectorized,
faster than Pillow's own resize and also without the GIL). spdl's
own decoders (`spdl.io`) need FFmpeg shared libraries that a plain pip install does
not bring, so they are not used here.
"""

import io
import math
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageFile, UnidentifiedImageError

# What decoding raises for corrupt, truncated or unsupported files. Pillow's
# DecompressionBombError subclasses Exception, not OSError: Pillow raises it from
# the header alone, before decoding, for more than 2 x Image.MAX_IMAGE_PIXELS (179 Mpx),
# so such a file is a bad image; below that Pillow only warns, and large JPEGs decode at
# reduced scale (draft_scale), in little memory.
DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    UnidentifiedImageError,
    Image.DecompressionBombError,
)

# Start-of-frame markers of the Huffman-coded JPEGs the direct path decodes: baseline,
# extended sequential, progressive. Others (lossless, arithmetic, hierarchical) go
# through Pillow.
_SOF_DIRECT = (0xC0, 0xC1, 0xC2)
# Markers that carry no length field (TEM, RST0-7, SOI, EOI).
_NO_LENGTH = {0x01, *range(0xD0, 0xDA)}
# Per-thread buffers larger than this are not kept for the next image.
_SCRATCH_KEEP_BYTES = 32 << 20
# torch's antialiased bilinear resize, writing into a given tensor (F.interpolate's
# kernel; F.interpolate always allocates its output).
_resize_aa_out = torch.ops.aten._upsample_bilinear2d_aa.out


class _ThreadScratch(threading.local):
    """Buffers that one thread reuses from image to image.

    Fresh buffers for every image cost page faults (the resize output alone: ~60 us of
    ~80), and each torch call made from Python lets another thread take the GIL; the
    resize output is also mapped once as a PIL image for the RGBX -> RGB packing.
    """

    def __init__(self):
        self.flat = {}
        self.resized = {}

    def array(self, name, shape):
        """A uint8 array of `shape` in this thread's buffer `name` (contents kept only
        until the next call with the same name)."""
        need = math.prod(shape)
        buf = self.flat.get(name)
        if buf is None or buf.size < need:
            buf = np.empty(need, dtype=np.uint8)
            if need <= _SCRATCH_KEEP_BYTES:
                self.flat[name] = buf
        return buf[:need].reshape(shape)

    def resize_target(self, height, width):
        """(tensor (1, 4, height, width) channels-last, PIL RGBX image) over one
        reused buffer."""
        target = self.resized.get((height, width))
        if target is None:
            rgbx = np.empty((height, width, 4), dtype=np.uint8)
            tensor = torch.from_numpy(rgbx.transpose(2, 0, 1)[None])
            image = Image.frombuffer("RGBX", (width, height), rgbx, "raw", "RGBX", 0, 1)
            target = self.resized[(height, width)] = (tensor, image)
        return target


_scratch = _ThreadScratch()


def jpeg_rgb_size(data: bytes) -> tuple[int, int] | None:
    """Returns (width, height) from the header of a 3-component (YCbCr or RGB)
    Huffman-coded JPEG in `data` (bytes), or None for anything else: another format,
    grayscale, CMYK, other codings, or a header that does not parse."""
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # Fill byte before a marker.
            i += 1
            continue
        if marker in _NO_LENGTH or marker == 0xDA:  # SOS before any frame header.
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if marker not in _SOF_DIRECT or i + 10 > n:
                return None
            height = (data[i + 5] << 8) | data[i + 6]
            width = (data[i + 7] << 8) | data[i + 8]
            if data[i + 9] != 3 or not width or not height:
                return None
            return width, height
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


def draft_scale(
    size: tuple[int, int], box: Sequence[float], out_size: tuple[int, int]
) -> int:
    """The DCT scale (1, 2, 4 or 8) at which a JPEG of `size` = (w, h) still yields a
    crop `box` = (left, top, right, bottom) of at least `out_size` = (w, h) pixels.

    The same choice as Pillow's `Image.draft` for the size `draft_for` requests.
    """
    w, h = size
    want = (
        math.ceil(w * out_size[0] / max(box[2] - box[0], 1e-6)),
        math.ceil(h * out_size[1] / max(box[3] - box[1], 1e-6)),
    )
    if want[0] * 2 > w or want[1] * 2 > h:
        return 1
    ratio = min(w // want[0], h // want[1])
    return next(s for s in (8, 4, 2, 1) if ratio >= s)


def decode_jpeg_rgbx(data: bytes, size: tuple[int, int], scale: int = 1) -> np.ndarray:
    """Decodes the JPEG `data` (bytes; `size` = (w, h) from `jpeg_rgb_size`) at
    1/`scale` into this thread's decode buffer.

    Returns a uint8 (ceil(h / scale), ceil(w / scale), 4) RGBX array (X = 255), valid
    until this thread decodes again. Pillow's own decoder, driven as `ImageFile.load`
    drives it but fed the whole file at once: one call, with the GIL released. Raises
    OSError for truncated or corrupt data.
    """
    width, height = -(-size[0] // scale), -(-size[1] // scale)
    rgbx = _scratch.array("decode", (height, width, 4))
    target = Image.frombuffer("RGBX", (width, height), rgbx, "raw", "RGBX", 0, 1)
    decoder = Image._getdecoder("RGB", "jpeg", ("RGB", ""), (scale, 0))
    try:
        decoder.setimage(target.im, (0, 0, width, height))
        consumed, err = decoder.decode(data)
    finally:
        decoder.cleanup()
    if err < 0:
        raise OSError(ImageFile.ERRORS.get(err, f"decoder error {err}"))
    if consumed >= 0:  # The decoder wants more data than the file holds.
        raise OSError("image file is truncated")
    return rgbx


def _pixel_box(box, width, height):
    """`box` rounded to whole pixels, at least one pixel, inside width x height."""
    left, top = min(round(box[0]), width - 1), min(round(box[1]), height - 1)
    right, bottom = max(round(box[2]), left + 1), max(round(box[3]), top + 1)
    return max(left, 0), max(top, 0), min(right, width), min(bottom, height)


def resize_crop_into(
    rgbx: np.ndarray, box: Sequence[float], out: np.ndarray, flip: bool = False
) -> None:
    """Crops `box` out of `rgbx`, resizes it to `out`'s size, mirrors it if `flip`, and
    writes it into `out`.

    `rgbx`: uint8 (h, w, 4) array (RGB + one unused channel); `box` = (left, top,
    right, bottom), rounded to whole pixels; `out`: writable uint8 (H, W, 3) array.
    The resize is torch's antialiased bilinear (Pillow's BILINEAR filter, vectorized
    for channels-last uint8 with 4 channels; one thread for any input size, so it
    does not oversubscribe the cores under loader threads). It filters within the
    crop, where Pillow's `resize(box=...)` also reads the pixels just outside it: only
    the outermost output pixels differ.
    """
    left, top, right, bottom = _pixel_box(box, rgbx.shape[1], rgbx.shape[0])
    # Copied by numpy (one thread, GIL released): given the strided view, torch would
    # make it contiguous itself with its intra-op threads, an OpenMP team per loader
    # thread (oversubscribing the cores, and hanging any process forked afterwards).
    crop = _scratch.array("crop", (bottom - top, right - left, 4))
    np.copyto(crop, rgbx[top:bottom, left:right])
    height, width = out.shape[:2]
    resized, image = _scratch.resize_target(height, width)
    # (1, 4, h, w) channels-last view of the crop, made by numpy: no torch call.
    _resize_aa_out(
        torch.from_numpy(crop.transpose(2, 0, 1)[None]),
        [height, width],
        False,
        None,
        None,
        out=resized,
    )
    # Pillow mirrors the result and drops the 4th channel in one thread, faster than a
    # strided copy (torch's flip would start intra-op threads).
    if flip:  # Mirroring commutes with the resize (the filter is symmetric).
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    rgb = image.tobytes("raw", "RGB")
    out[...] = np.frombuffer(rgb, dtype=np.uint8).reshape(height, width, 3)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """Returns the bytes of the file at `path`.

    Four system calls (open, fstat, read, close), where `open(path).read()` makes
    nine (a second fstat, isatty, two lseeks, a second read to find the end): each
    releases the GIL and lets another loader thread take it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size)
        while len(data) < size:  # Large files may come in several pieces.
            more = os.read(fd, size - len(data))
            if not more:
                break  # Truncated meanwhile: decoding will say so.
            data += more
    finally:
        os.close(fd)
    return data


class EncodedImage:
    """The bytes of one image file, its size read from the header, decoded on demand.

    `size` = (w, h). RGB JPEGs (`direct`) are decoded by `decode_jpeg_rgbx` without a
    PIL object; other files are opened by Pillow (`pil()`), which raises the
    DECODE_ERRORS for data it cannot read.
    """

    __slots__ = ("data", "size", "_pil")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._pil = None
        size = jpeg_rgb_size(data)
        limit = Image.MAX_IMAGE_PIXELS
        if size is not None and (limit is None or size[0] * size[1] <= limit):
            self.size = size
        else:  # Pillow parses it, with its decompression-bomb checks.
            self.size = self.pil().size

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "EncodedImage":
        """Reads the whole file at `path` (read_file)."""
        return cls(read_file(path))

    @property
    def direct(self) -> bool:
        """Whether the file is decoded without Pillow's header parsing."""
        return self._pil is None

    def pil(self) -> Image.Image:
        """The image opened lazily by Pillow (header parsed, pixels decoded on use)."""
        if self._pil is None:
            self._pil = Image.open(io.BytesIO(self.data))
        return self._pil

    def close(self) -> None:
        if self._pil is not None:
            self._pil.close()

    def crop_flip_resize_into(
        self, box: Sequence[float], out: np.ndarray, flip: bool = False
    ) -> None:
        """Decodes the image (at reduced JPEG scale where the crop allows), crops `box`
        (full-size pixels), mirrors it if `flip` and resizes it into `out`, a writable
        uint8 (H, W, 3) array."""
        out_size = (out.shape[1], out.shape[0])
        if not self.direct:
            return resize_crop_into(*_pil_rgbx(self.pil(), box, out_size), out, flip)
        scale = draft_scale(self.size, box, out_size)
        rgbx = decode_jpeg_rgbx(self.data, self.size, scale)
        if scale > 1:
            sx, sy = rgbx.shape[1] / self.size[0], rgbx.shape[0] / self.size[1]
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        return resize_crop_into(rgbx, box, out, flip)


def open_image(path: str | os.PathLike[str]) -> Image.Image:
    """Reads the file at `path` and opens it lazily with Pillow (parses the header
    only, decodes on first use); returns a PIL Image."""
    return EncodedImage.read(path).pil()


def draft_for(
    im: Image.Image, box: Sequence[float], out_size: tuple[int, int]
) -> Sequence[float]:
    """Lets a PIL JPEG decode at 1/2, 1/4 or 1/8 scale if the crop stays >= `out_size`.

    `box` = (left, top, right, bottom) in the full-size image; returns the box in the
    coordinates of the (possibly reduced) image that decoding will produce.
    """
    if im.format != "JPEG":
        return box
    w, h = im.size
    scale = draft_scale(im.size, box, out_size)
    if scale == 1:
        return box  # No reduction possible; skip draft's bookkeeping.
    # Pillow picks the largest scale that keeps the decoded size >= the requested one.
    im.draft("RGB", (w // scale, h // scale))
    sx, sy = im.size[0] / w, im.size[1] / h
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def to_rgb(im: Image.Image) -> Image.Image:
    """Returns `im` as RGB: grayscale, palette, CMYK and alpha images are converted
    (alpha is dropped, as OpenCV's imread does for pycls)."""
    if im.mode == "RGB":
        return im
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")  # Avoids Pillow's warning on palette transparency.
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale PNG: keep the top 8 bits, not a clipped copy of the low ones.
        im = im.point(lambda v: v / 256).convert("L")
    return im.convert("RGB")


def crop_resize(
    im: Image.Image, box: Sequence[float], out_size: tuple[int, int]
) -> Image.Image:
    """Decodes `im`, crops `box` and resizes it to `out_size` = (w, h) in one call.

    Uses a JPEG draft when it keeps enough pixels; returns an RGB PIL Image.
    """
    box = draft_for(im, box, out_size)
    im = to_rgb(im)
    return im.resize(out_size, Image.BILINEAR, box=box)


def crop_flip_resize(
    im: Image.Image, box: Sequence[float], out_size: tuple[int, int], flip: bool = False
) -> np.ndarray:
    """Decodes the PIL image `im`, crops `box`, optionally mirrors it and resizes it to
    `out_size` = (w, h) as `EncodedImage.crop_flip_resize_into` does; returns a
    C-contiguous uint8 (h, w, 3) RGB array."""
    out = np.empty((out_size[1], out_size[0], 3), dtype=np.uint8)
    resize_crop_into(*_pil_rgbx(im, box, out_size), out, flip)
    return out


def _pil_rgbx(im, box, out_size):
    """Decodes the PIL image `im` (JPEG draft where the crop allows) to a uint8
    (h, w, 4) RGBX array; returns it and `box` in its coordinates."""
    box = draft_for(im, box, out_size)
    return np.asarray(to_rgb(im).convert("RGBX")), box
