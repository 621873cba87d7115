"""Store URLs checked before anything opens, prints or names an object after them, and text made
fit to print when it may hold a URL.

Credentials never come from a URL: a query string (an Azure SAS token `?sv=...&sig=...`, a presigned
`X-Amz-Signature`) or a `user:password@` in a store URL is refused, and the refusal shows the URL
without it. Path segments `.` and `..` are refused too: an object store keeps them literally, as
names no local path reaches, where a local folder would resolve them (a local path that escapes
its root is refused elsewhere). tests/integration/test_url_secrets.py plants a secret in every
such form and sweeps each command's output for it.
"""

from __future__ import annotations

import re

from .errors import UsageError

MASK = "***"
# scheme://user:password@ (or user@): the userinfo part of any URL in a text
_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/\s@?#'\"]*@")
# ?query or #fragment of any URL in a text, up to the next space or quote
_QUERY = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s?#'\"]*)[?#][^\s'\"]*")


def masked(text: str) -> str:
    """`text` with every URL's userinfo and query (or fragment) replaced by ***, e.g. for a value
    quoted back in an error, or a client's error that quotes its request."""
    return _QUERY.sub(rf"\1?{MASK}", _USERINFO.sub(rf"\1{MASK}@", text))


def without_userinfo(text: str) -> str:
    """`text` with every URL's `user:password@` replaced by ***@, its query kept: for a URL list's
    image URLs, whose queries are part of what they name."""
    return _USERINFO.sub(rf"\1{MASK}@", text)


def check_store_url(url: str) -> None:
    """Refuse (UsageError, the URL shown masked) an object-store URL with a query, a fragment, a
    password, or a `.`/`..` path segment. `container@account.host` (Azure's abfs form) is a host,
    not a credential; a `:` before its `@` is a password. A local path (or file:// URL) is a path,
    whatever characters it holds: nothing to check."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() == "file":
        return
    authority, _, path = rest.partition("/")
    if "?" in rest or "#" in rest:
        raise UsageError(
            f"{masked(url)}: a store URL takes no query string or fragment (?..., #...): credentials never come from "
            "a URL; give them to the store's standard chain (environment, credential files, role)"
        )
    userinfo, at, _ = authority.rpartition("@")
    if at and ":" in userinfo:
        raise UsageError(
            f"{masked(url)}: a store URL takes no user or password (...@): credentials never come "
            "from a URL; give them to the store's standard chain (environment, credential files, role)"
        )
    if any(segment in (".", "..") for segment in path.split("/")):
        raise UsageError(
            f"{masked(url)}: a store URL takes no '.' or '..' path segment (an object store would "
            "keep it as part of the name): write the path it means"
        )


def check_no_userinfo(url: str, what: str, instead: str, error: type[UsageError] = UsageError) -> None:
    """Refuse a server's URL (a tracking server's) with a user, password or token before an `@`:
    `error` naming `what` (a key, an environment variable), never the URL; `instead`: where the
    credentials go."""
    authority = url.partition("://")[2].partition("/")[0]
    if "@" in authority:
        raise error(f"{what} holds credentials (user:password@host): set {instead} in the environment instead")
