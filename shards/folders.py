"""Listing a class-folder tree (or a plain folder of images) on local disk or in a store: one folder
at a time, in the order sorting by relative path gives, with links followed only inside a boundary.

Per listing: the folders of the tree (names, not files) and one folder's entries at a time."""

from __future__ import annotations

import logging
import os
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from vitforge.core import Store, open_store

from .manifests import root_check
from .records import SourceError, SourceRecord, display_path

log = logging.getLogger("vitforge.shard")
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}


FileEntry = tuple  # (path relative to src with "/" separators, path or URL to read, size, problem)


def remote_files(src: str, by_class: bool, share: tuple[int, int] | None = None) -> Iterator[FileEntry]:
    """Every object under src in the order sorting by relative path gives (by class folder name
    first when `by_class`), whatever the store: listed one folder at a time (`list_folder`), each
    folder sorted here (object stores do not all list in key order). Object stores have no links,
    and a listing error is the store's, for the whole run. `share` (s, n): only what share s of n
    of the top level's entries holds (a job array's task plans its share: shards/array_plan.py)."""
    store = open_store(src)
    first = share_of(_store_folder(store, "", top_by_class=by_class), share)
    for name, size, _, _ in _depth_first(first, lambda folder: _store_folder(store, folder)):
        yield name, store.url(name), size, None


def _store_folder(store: Store, folder: str, top_by_class: bool = False) -> list:
    """(name, size, None, is_folder) of one folder's objects and subfolders, in relative-path order
    (as `_folder_entries`). `top_by_class`: only its subfolders, in name order."""
    subfolders, objects = store.list_folder(folder)
    base = f"{folder}/" if folder else ""
    if "" in subfolders:  # keys with "//": store names cannot address them, and listing "" again never ends
        log.warning(
            "%s: objects under an empty path segment (a key with '//') are left out",
            display_path(store.url(base + "/")),
        )
        subfolders = [sub for sub in subfolders if sub]
    keyed = [(sub if top_by_class else sub + "/", (base + sub, 0, None, True)) for sub in subfolders]
    if not top_by_class:
        keyed += [(name, (base + name, size, None, False)) for name, size in objects.items()]
    keyed.sort(key=lambda k: k[0])
    return [item for _, item in keyed]


def local_files(
    src: str, follow_symlinks: bool, boundary: str, by_class: bool, share: tuple[int, int] | None = None
) -> Iterator[FileEntry]:
    """Every file under src, and every folder under it that cannot be listed (with its problem), in
    the order sorting by relative path gives (by class folder name first when `by_class`, files
    directly in src left out). Two passes: `_listed_folders` decides which folders are listed and
    through which path (links and loops), then each is listed again, one folder at a time.
    `share`: as for `remote_files` (the first pass still walks every folder, not their files)."""
    listed, unreadable = _listed_folders(src, follow_symlinks, boundary)
    if share is None:
        first = _folder_entries(src, listed, unreadable, top_by_class=by_class)
    else:  # the top level's files stat'ed only in this share (a flat folder's are all of them)
        top = share_of(_folder_entries(src, listed, unreadable, top_by_class=by_class, sized=False), share)
        first = [
            (path, _file_size(path) if size is None else size, problem, folder) for path, size, problem, folder in top
        ]
    for path, size, problem, _ in _depth_first(first, lambda folder: _folder_entries(folder, listed, unreadable)):
        yield _relative(path, src), path, size, problem


def share_of(entries: list, share: tuple[int, int] | None) -> list:
    """Share s of n of a sorted list: contiguous, so shares in order are the listing's order."""
    if share is None:
        return entries
    s, n = share
    return entries[s * len(entries) // n : (s + 1) * len(entries) // n]


def _depth_first(first: list, entries: Callable[[str], list]) -> Iterator[tuple]:
    """The non-folder entries (where, size, problem, is_folder) of a tree, each folder's `entries`
    expanded in its place: with each folder's entries sorted by name, a "/" after folder names,
    this is the order of the full relative paths. Holds one folder's entries per level."""
    stack = [iter(first)]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
        elif entry[3]:
            stack.append(iter(entries(entry[0])))
        else:
            yield entry


def _folder_entries(
    folder: str, listed: set[str], unreadable: dict[str, tuple], top_by_class: bool = False, sized: bool = True
) -> list:
    """(path, size, problem, is_folder) of one folder's files, unreadable subfolders and subfolders
    to descend, in relative-path order. `top_by_class`: only its subfolders, in name order.
    `sized=False`: files' sizes None (`_file_size` later), so listing a folder stats nothing."""
    try:
        with os.scandir(folder) as it:
            scanned = list(it)
    except OSError as e:  # listed a moment ago: it changed since
        return [(folder, 0, _unlistable(e), False)]
    keyed: list[tuple[str, tuple]] = []  # (sort key, entry)
    for entry in scanned:
        if _is_folder(entry):
            if entry.path in listed:
                keyed.append((entry.name if top_by_class else entry.name + "/", (entry.path, 0, None, True)))
            elif entry.path in unreadable:
                keyed.append((entry.name, (entry.path, 0, unreadable[entry.path], False)))
        elif not top_by_class:
            keyed.append((entry.name, (entry.path, _file_size(entry.path, entry) if sized else None, None, False)))
    keyed.sort(key=lambda k: k[0])
    return [item for _, item in keyed]


def _file_size(path: str, entry: os.DirEntry | None = None) -> int:
    try:
        info = entry.stat(follow_symlinks=True) if entry is not None else os.stat(path)
        return info.st_size if stat.S_ISREG(info.st_mode) else 0
    except OSError:
        return 0  # unreadable or a looping link: reading it later names the cause


def _unlistable(e: OSError) -> tuple[str, str]:
    return ("unreadable", f"folder cannot be listed: {type(e).__name__}: {e.strerror or e}")


def _relative(path: str, src: str) -> str:
    return os.path.relpath(path, src).replace(os.sep, "/")


def _is_image(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in IMAGE_EXTENSIONS


def from_folder(src: str, files: Iterable[FileEntry], required: bool = True) -> Iterator[SourceRecord]:
    """`required`: an error when there is no image (a share of a folder may have none)."""
    found = False
    for rel, url, size, problem in files:
        if problem or _is_image(rel):
            found = True
            yield SourceRecord(url, None, size, problem=problem, name=rel)
    if required and not found:
        raise SourceError(f"{display_path(src)}: no images found under it")


def from_class_folders(
    src: str, files: Iterable[FileEntry], classes: list[str] | None, names: list[str], required: bool = True
) -> Iterator[SourceRecord]:
    """`files` come class by class in name order, so without a class map each class that holds
    an input takes the next id as its first input comes (appended to `names`): the ids sorting
    the class names would give. `required`: as for `from_folder`."""
    ids = {name: i for i, name in enumerate(names)}
    found = False
    for rel, url, size, problem in files:
        name = rel.split("/", 1)[0]
        # An unlistable folder directly under SRC is still a class folder: its class keeps its id.
        if not (problem or ("/" in rel and _is_image(rel))):
            continue
        found = True
        if classes is None and name not in ids:
            ids[name] = len(names)
            names.append(name)
        record = SourceRecord(url, ids.get(name), size, problem=problem, name=rel)
        if record.label is None and not problem:
            record.problem = ("label_unknown", f"class folder {display_path(name)!r} is not in the class map")
        yield record
    if required and not found:
        raise SourceError(f"{display_path(src)}: no images found in class folders (expected SRC/CLASS/IMAGE)")


def _listed_folders(src: str, follow_symlinks: bool, boundary: str) -> tuple[set[str], dict[str, tuple]]:
    """The folders under src that are listed (by the path that lists them) and those that cannot
    be (path -> problem): a set of paths per folder, nothing per file. src itself may be a link.
    Symlinked folders below it are skipped unless `follow_symlinks`; then only those leading inside
    `boundary` are followed, after the real folders, so each real folder is listed once and, when
    src holds it, under its own name."""
    inside = root_check(boundary)
    seen: set[tuple[int, int]] = set()
    listed: set[str] = set()
    unreadable: dict[str, tuple] = {}
    not_followed, outside, repeated = [], [], []
    links = deque([src])  # src, then each folder reached through a link, in the order they were found
    while links:
        stack = [links.popleft()]
        while stack:
            folder = stack.pop()
            try:
                st = os.stat(folder)
                if (st.st_dev, st.st_ino) in seen:
                    repeated.append(folder)  # a loop, or a second way into a folder already listed
                    continue
                seen.add((st.st_dev, st.st_ino))
                with os.scandir(folder) as it:  # sorted: which link lists a folder is fixed
                    folders = sorted((e for e in it if _is_folder(e)), key=lambda e: e.name)
            except OSError as e:
                if folder == src:
                    raise  # nothing of the corpus can be read: an environment error for the whole run
                unreadable[folder] = _unlistable(e)
                continue
            listed.add(folder)
            subfolders = []
            for entry in folders:
                if entry.is_symlink():
                    if not follow_symlinks:
                        not_followed.append(entry.path)
                    elif inside(entry.path):
                        links.append(entry.path)
                    else:
                        outside.append(entry.path)
                else:
                    subfolders.append(entry.path)
            stack.extend(reversed(subfolders))
    _report_links(src, boundary, not_followed, outside, repeated)
    return listed, unreadable


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=True)
    except OSError:
        return False


def _report_links(src: str, boundary: str, not_followed: list[str], outside: list[str], repeated: list[str]) -> None:
    def named(paths: list[str], target: bool = False) -> str:
        shown = [
            display_path(_relative(p, src)) + (f" -> {display_path(os.path.realpath(p))}" if target else "")
            for p in paths[:5]
        ]
        return ", ".join(shown) + (f", and {len(paths) - 5} more" if len(paths) > 5 else "")

    if not_followed:
        log.warning(
            "skipped %d symlinked folders under %s (%s): folder links are followed only with --follow-symlinks",
            len(not_followed),
            display_path(src),
            named(not_followed),
        )
    if outside:
        log.warning(
            "skipped %d symlinked folders that lead outside %s (%s): widen with --root",
            len(outside),
            display_path(os.path.realpath(boundary)),
            named(outside, target=True),
        )
    if repeated:
        log.info(
            "%d symlinked folders lead to folders already listed (%s); each is listed once",
            len(repeated),
            named(repeated),
        )
