"""A corrupt-input zoo, generated: every kind of bad or awkward input the sharder must survive."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from vitforge.synthetic import class_image, jpeg_bytes

NON_UTF8_NAME = b"caf\xe9_latin1.jpg"


def _png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int = 40000, height: int = 40000) -> bytes:
    """A valid PNG header claiming 1.6 gigapixels, with a tiny body."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b"")


def good_pixels(label: int = 0, size=(64, 48)) -> np.ndarray:
    return class_image(label, 4, np.random.default_rng(label), size, 8.0)


def write_zoo(root: Path) -> dict[str, str]:
    """Write ROOT/zoo/<files> (one class folder); return file name -> expected outcome
    ("packed", "normalised:<change>" or "rejected:<reason>")."""
    folder = root / "zoo"
    folder.mkdir(parents=True)
    expected = {}

    def put(name: str, data: bytes, outcome: str):
        (folder / name).write_bytes(data)
        expected[name] = outcome

    good = jpeg_bytes(good_pixels())
    put("good.jpg", good, "packed")
    put("truncated.jpg", good[: len(good) // 2], "rejected:truncated")
    put("random_bytes.jpg", np.random.default_rng(1).bytes(4096), "rejected:not_an_image")
    put("zero_bytes.jpg", b"", "rejected:empty")
    rgba = Image.fromarray(good_pixels(1)).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    put("alpha.png", _png_bytes(rgba), "normalised:mode_RGBA")
    cmyk = io.BytesIO()
    Image.fromarray(good_pixels(2)).convert("CMYK").save(cmyk, "JPEG", quality=90)
    put("cmyk.jpg", cmyk.getvalue(), "normalised:mode_CMYK")
    ramp = (np.arange(64 * 48, dtype=np.uint32).reshape(48, 64) * 21).astype(np.uint16)  # 0 .. 64491
    put("sixteen_bit.png", _png_bytes(Image.fromarray(ramp)), "normalised:mode_I;16")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    put("exif_rotated.jpg", jpeg_bytes(good_pixels(3, (80, 40)), exif=exif.tobytes()), "normalised:exif_orientation")
    gray = io.BytesIO()
    Image.fromarray(good_pixels()).convert("L").save(gray, "JPEG", quality=90)
    put("grayscale.jpg", gray.getvalue(), "normalised:mode_L")
    palette = Image.fromarray(good_pixels(1)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    put("palette.png", _png_bytes(palette), "normalised:mode_P")
    put("bomb.png", bomb_png(), "rejected:decompression_bomb")
    put("tiny.jpg", jpeg_bytes(good_pixels(0, (6, 5))), "rejected:too_small")
    put("extraneous.jpg", _extraneous(good), "normalised:repair")
    (folder / "unreadable.jpg").write_bytes(good)
    os.chmod(folder / "unreadable.jpg", 0)
    expected["unreadable.jpg"] = "rejected:unreadable"
    os.symlink("loop_b.jpg", folder / "loop_a.jpg")
    os.symlink("loop_a.jpg", folder / "loop_b.jpg")
    expected["loop_a.jpg"] = expected["loop_b.jpg"] = "rejected:unreadable"
    with open(os.path.join(os.fsencode(folder), NON_UTF8_NAME), "wb") as f:
        f.write(good)
    expected[os.fsdecode(NON_UTF8_NAME)] = "packed"
    return expected


def _extraneous(jpeg: bytes) -> bytes:
    """Garbage bytes before the EOI marker: libjpeg warns, every pixel is still there."""
    return jpeg[:-2] + b"\x00" * 16 + jpeg[-2:]
