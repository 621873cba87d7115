"""One input to one sample (or one reject): what every validation worker runs.

The input is a plan item and, for a URL list, its download (`Fetched`), for a datasets Parquet
file the image bytes read from it, else None (the worker reads the source itself).
"""

from __future__ import annotations

import hashlib
import json
import os

from vitforge.core import StorageError

from .download import Fetched
from .hf_parquet import shown_source
from .images import Encoded, ImageOptions, Rejected, normalise, sniff
from .plan_slices import PlanItem
from .sources import read_source


def to_sample(
    pair: tuple[PlanItem, Fetched | bytes | None],
    *,
    opts: ImageOptions,
    classes: tuple[str, ...],
    caption: str | None,
    src: str,
) -> dict:
    """Runs in a worker: read (or take the download, or the bytes embedded in SRC, of), validate and
    normalise one input into a sample (or a reject)."""
    item, fetched = pair
    embedded = fetched if isinstance(fetched, bytes) else None
    fetched = None if isinstance(fetched, bytes) else fetched
    shown = shown_source(item.source, src)
    if item.problem:
        return {"reject": {"key": item.key, "source": shown, "reason": item.problem[0], "detail": item.problem[1]}}
    if fetched is not None and fetched.data is None:
        return {
            "reject": {
                "key": item.key,
                "source": shown,
                "reason": fetched.reason,
                "detail": fetched.detail,
                "status": fetched.status,
                "retryable": fetched.retryable,
                "host": fetched.host,
            }
        }
    try:
        data, ext_hint = _image_bytes(item, fetched, embedded)
        encoded = normalise(data, ext_hint, opts)
    except Rejected as e:
        downloaded = {} if fetched is None else {"status": fetched.status, "host": fetched.host}
        return {"reject": {"key": item.key, "source": shown, "reason": e.reason, "detail": e.detail, **downloaded}}
    except StorageError:
        raise  # the store itself failed (its deadline passed): no image is to blame
    except OSError as e:
        detail = f"{type(e).__name__}: {e.strerror or e}"
        return {"reject": {"key": item.key, "source": shown, "reason": "unreadable", "detail": detail}}
    return _sample(item, fetched, data, encoded, opts, classes, caption, shown)


def _image_bytes(item: PlanItem, fetched: Fetched | None, embedded: bytes | None) -> tuple[bytes, str]:
    """The input's bytes and the image type they are taken for: the bytes embedded in SRC, the
    download, or the source read here."""
    if embedded is not None:
        return embedded, sniff(embedded) or "jpg"  # unknown bytes: the decoder names what is wrong with them
    if fetched is not None:
        data = fetched.data
        ext_hint = sniff(data)  # a URL's name and Content-Type are hints a server can get wrong
        if ext_hint is None:
            raise Rejected("not_an_image", f"served as {fetched.content_type or 'no type'}, starts with {data[:16]!r}")
        return data, ext_hint
    data = read_source(item.source)
    return data, os.path.splitext(item.source)[1].lower().lstrip(".").replace("jpeg", "jpg") or "jpg"


def _sample(
    item: PlanItem,
    fetched: Fetched | None,
    data: bytes,
    encoded: Encoded,
    opts: ImageOptions,
    classes: tuple[str, ...],
    caption: str | None,
    shown: str,
) -> dict:
    """The sample's tar members (image, label, caption, its JSON description) and what the shard's
    record counts of it."""
    info = {"source": shown, "sha256": hashlib.sha256(data).hexdigest(), "source_bytes": len(data)}
    if fetched is not None:
        info.update(url=fetched.url, final_url=fetched.final_url, status=fetched.status)
    if item.label is not None:
        info.update({"label": item.label, "class": classes[item.label]})
    if opts.validate:
        info.update(
            width=encoded.width,
            height=encoded.height,
            source_width=encoded.source_width,
            source_height=encoded.source_height,
        )
    if encoded.changes:
        info["normalised"] = list(encoded.changes)
    if item.meta:
        info["meta"] = item.meta
    label = {} if item.label is None else {"cls": str(item.label).encode()}
    text = item.meta.get(caption) if caption else None
    label.update({"txt": str(text).encode()} if text is not None else {})
    sample = {
        "__key__": item.key,
        encoded.ext: encoded.data,
        **label,
        "json": json.dumps(info, sort_keys=True).encode(),
    }
    return {
        "sample": sample,
        "label": item.label,
        "changes": encoded.changes,
        "bytes": len(data),
        "image_bytes": len(encoded.data),
        "short_side": min(encoded.width, encoded.height),
    }
