"""Validate and normalise one encoded image.

Every image is fully decoded before it may reach a shard: DALI aborts the whole pipeline on one
undecodable JPEG (docs/ARCHITECTURE.md, measured facts), so nothing that fails here is ever packed. Images that only
need normalising (EXIF rotation, CMYK / grayscale / palette / alpha / 16-bit, oversize) are
re-encoded; clean JPEG / PNG / WebP bytes are kept byte-for-byte.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from vitforge.core import UsageError

KEPT_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
ORIENTATION_TAG = 0x0112
# libjpeg warnings that leave every pixel intact: the stream is rewritten, the image kept.
HARMLESS_JPEG_WARNINGS = ("extraneous bytes before marker",)


class Rejected(Exception):
    """An input that cannot become a training sample; `reason` is a stable short code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ImageOptions:
    format: str = "keep"  # "keep": JPEG/PNG/WebP stay as they are; "jpeg": everything becomes JPEG
    quality: int = 95
    max_side: int | None = None
    min_side: int = 1
    max_pixels: int = 89_478_485  # Pillow's own default bomb threshold
    validate: bool = True

    def __post_init__(self):
        if self.format not in ("keep", "jpeg"):
            raise UsageError(f"format must be 'keep' or 'jpeg', not {self.format!r}")
        if not 1 <= self.quality <= 100:
            raise UsageError(f"quality must be in 1..100, not {self.quality}")
        if self.max_side is not None and self.max_side < 1:
            raise UsageError(f"max_side must be positive, not {self.max_side}")
        if self.min_side < 1:
            raise UsageError(f"min_side must be >= 1, not {self.min_side}")


@dataclass(frozen=True)
class Encoded:
    data: bytes
    ext: str
    width: int
    height: int
    source_width: int
    source_height: int
    changes: tuple[str, ...] = ()


def normalise(data: bytes, ext_hint: str, opts: ImageOptions) -> Encoded:
    """Return the bytes to pack for one image, or raise Rejected with the reason."""
    if not data:
        raise Rejected("empty", "zero-byte file")
    if not opts.validate:
        _check_signature(data, ext_hint)
        return Encoded(data, ext_hint, 0, 0, 0, 0)
    with _pixel_limit(opts.max_pixels):
        return _normalise(data, opts)


@contextlib.contextmanager
def _pixel_limit(limit: int):
    """Pillow's decompression-bomb guard, set to our limit for this decode only: every other
    process (loader, trainer) keeps Pillow's default guard. Validation runs one image at a time
    per process, so the global setting is not shared with another thread."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = limit
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


# What the first bytes of each kept format are: --no-validate still refuses to pack bytes that
# are not the image their name claims (a text file renamed .jpg, /etc/passwd listed in a manifest).
SIGNATURES = {"jpg": (b"\xff\xd8\xff",), "jpeg": (b"\xff\xd8\xff",), "png": (b"\x89PNG\r\n\x1a\n",), "webp": (b"RIFF",)}


# Formats recognised by their first bytes alone (what a downloaded body is, whatever its server says).
SNIFFED = (
    ("jpg", b"\xff\xd8\xff"),
    ("png", b"\x89PNG\r\n\x1a\n"),
    ("gif", b"GIF87a"),
    ("gif", b"GIF89a"),
    ("bmp", b"BM"),
    ("tiff", b"II*\x00"),
    ("tiff", b"MM\x00*"),
)


def sniff(data: bytes) -> str | None:
    """The image format `data` starts like (an extension), or None for anything else (HTML, text)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((ext for ext, magic in SNIFFED if data.startswith(magic)), None)


def _check_signature(data: bytes, ext: str) -> None:
    signatures = SIGNATURES.get(ext.lower().lstrip("."))
    if signatures is None:
        raise Rejected("not_an_image", f"--no-validate packs only JPEG, PNG and WebP, not .{ext}")
    if not data.startswith(signatures) or (ext == "webp" and data[8:12] != b"WEBP"):
        raise Rejected("not_an_image", f"the bytes are not a {ext.upper()} file (wrong signature)")


def _normalise(data: bytes, opts: ImageOptions) -> Encoded:
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise Rejected("not_an_image", "no image format recognises these bytes") from None
    except Image.DecompressionBombError as e:
        raise Rejected("decompression_bomb", f"{e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise Rejected("corrupt", f"header unreadable: {e}") from None
    width, height = image.size
    if width * height > opts.max_pixels:
        raise Rejected("decompression_bomb", f"{width}x{height} = {width * height} pixels > limit {opts.max_pixels}")
    try:
        orientation = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block is not worth losing the image for
        orientation = 1
    changes = _needed_changes(image, orientation, opts)
    strictly_decoded = image.format == "JPEG" and image.mode in ("RGB", "L")
    if strictly_decoded:
        changes += _check_jpeg(data, width, height)
    if not changes:
        if not strictly_decoded:
            _decode_fully(image)
        _check_min_side(width, height, opts)
        return Encoded(data, KEPT_FORMATS[image.format], width, height, width, height)
    return _reencode(image, changes, opts)


def _needed_changes(image: Image.Image, orientation: int, opts: ImageOptions) -> tuple[str, ...]:
    changes = []
    if image.format not in KEPT_FORMATS or (opts.format == "jpeg" and image.format != "JPEG"):
        changes.append("format")
    if orientation not in (1, None):
        changes.append("exif_orientation")
    if image.mode not in ("RGB",):
        changes.append(f"mode_{image.mode}")
    if opts.max_side and max(image.size) > opts.max_side:
        changes.append("resize")
    return tuple(changes)


def _check_jpeg(data: bytes, width: int, height: int) -> tuple[str, ...]:
    """Strict libjpeg-turbo decode: every libjpeg warning is an error, except harmless ones.

    Decoding at 1/8 scale still entropy-decodes every coefficient of every scan, which is where
    corruption shows; it only skips the full-size IDCT and colour conversion (about 30% faster)."""
    try:
        simplejpeg.decode_jpeg(data, strict=True, min_width=max(1, width // 8), min_height=max(1, height // 8))
        return ()
    except ValueError as e:
        message = str(e)
    if message.startswith("Premature end"):
        raise Rejected("truncated", message)
    if any(w in message for w in HARMLESS_JPEG_WARNINGS):
        return ("repair",)
    raise Rejected("corrupt", message)


def _decode_fully(image: Image.Image) -> None:
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:
        reason = "truncated" if "truncated" in str(e) else "corrupt"
        raise Rejected(reason, str(e)) from None


def _check_min_side(width: int, height: int, opts: ImageOptions) -> None:
    if min(width, height) < opts.min_side:
        raise Rejected("too_small", f"{width}x{height} has a side under --min-side {opts.min_side}")


def _reencode(image: Image.Image, changes: tuple[str, ...], opts: ImageOptions) -> Encoded:
    source_size, source_format = image.size, image.format
    if "resize" in changes and image.format == "JPEG" and image.mode in ("RGB", "L"):
        # DCT-domain downscale: decodes at 1/2, 1/4 or 1/8 size when that still covers the target.
        image.draft(image.mode, _fit(image.size, opts.max_side))
    _decode_fully(image)
    image = ImageOps.exif_transpose(image) if "exif_orientation" in changes else image
    image = _to_rgb(image)
    if "resize" in changes:
        image = image.resize(_fit(image.size, opts.max_side), Image.Resampling.LANCZOS, reducing_gap=3.0)
    _check_min_side(*image.size, opts)
    as_jpeg = opts.format == "jpeg" or source_format == "JPEG"
    out = io.BytesIO()
    if as_jpeg:
        image.save(out, "JPEG", quality=opts.quality, subsampling=0 if opts.quality >= 90 else 2, optimize=False)
    else:
        image.save(out, "PNG", compress_level=6)
    return Encoded(out.getvalue(), "jpg" if as_jpeg else "png", *image.size, *source_size, changes)


def _fit(size: tuple[int, int], max_side: int | None) -> tuple[int, int]:
    width, height = size
    if not max_side or max(width, height) <= max_side:
        return size
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # Pillow's convert() clips 16-bit values to 255 instead of scaling them.
        pixels = np.asarray(image, dtype=np.uint32)
        peak = 65535 if image.mode.startswith("I;16") or pixels.max() > 255 else 255
        image = Image.fromarray((pixels * 255 // peak).astype(np.uint8), "L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        # Transparent pixels carry arbitrary colours: composite on white rather than expose them.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def check_decodes(data: bytes) -> None:
    """Raise Rejected unless `data` decodes completely (what `shard verify` asks of packed images)."""
    if not data:
        raise Rejected("empty", "zero-byte image")
    if data[:3] == b"\xff\xd8\xff":
        try:
            simplejpeg.decode_jpeg(data, strict=True)
            return
        except ValueError as e:
            raise Rejected("corrupt", str(e)) from None
    try:
        Image.open(io.BytesIO(data)).load()
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError) as e:
        raise Rejected("corrupt", str(e) or type(e).__name__) from None
