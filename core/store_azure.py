"""Azure Blob Storage as a Store, through azure-storage-blob: `az://container/prefix` (the account
from the credentials) and adlfs's forms `abfs[s]://container@account.dfs.core.windows.net/prefix`
(also `az://container@account/prefix`).

Writes are a single Put Blob for small objects, or blocks staged in parallel and committed by one
Put Block List: a blob is visible only when whole. put_if and a pinned read are conditional
requests on the blob's ETag (If-None-Match "*" to create). Credentials come from the standard
chain only: AZURE_STORAGE_CONNECTION_STRING; else the account (URL, AZURE_STORAGE_ACCOUNT_NAME)
with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN; else azure-identity's DefaultAzureCredential
(environment, workload or managed identity, `az login`). None of them is kept on the store or put
in a message.

Retries: the SDK retries throttling, 5xx, resets and timeouts itself, with the per-attempt
timeouts and attempt count of retry.py's `store_limits()`, a log line per failed attempt and the
enclosing operation's deadline (`_BoundedRetry`); we retry only a body cut short. Denials (403,
a bad key, a missing container) fail at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from .errors import PreconditionFailed, StorageError, UsageError
from .retry import TransientError, current_operation, past_deadline, store_limits, with_retries, with_retries_if_present
from .store import UPLOAD_THREADS, ObjectInfo, StagedStore, whole

try:
    from azure.core import MatchConditions
    from azure.core.exceptions import (
        AzureError,
        ClientAuthenticationError,
        HttpResponseError,
        IncompleteReadError,
        ResourceExistsError,
        ResourceModifiedError,
        ResourceNotFoundError,
        ServiceRequestError,
        ServiceResponseError,
    )
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobPrefix, BlobServiceClient, ExponentialRetry
except ImportError as e:  # an optional dependency: say how to get it rather than print a traceback
    raise UsageError(
        f"az:// and abfs:// stores need the Azure client ({e.name} is missing): pip install 'vitforge[azure]'"
    ) from None

log = logging.getLogger("vitforge.store")
# The SDK logs every request's headers at INFO (ten lines a request, secrets redacted): warnings only.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)
BLOCK_BYTES = 16 << 20  # per staged block; blocks in flight x this is what an upload holds in memory
SINGLE_PUT_BYTES = 32 << 20  # larger objects go up as parallel blocks
LIST_PAGE = 5000  # blobs per listing page (Azure's most): what a listing holds at a time
CONTAINER_NAME = re.compile(r"[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class AzureLocation:
    scheme: str
    container: str
    prefix: str
    host: str  # as the URL gave it after "@" ("account.dfs.core.windows.net", "account"), or ""

    @property
    def account(self) -> str | None:
        """None: from the credentials (the connection string or AZURE_STORAGE_ACCOUNT_NAME)."""
        return self.host.partition(".")[0] or None

    @property
    def suffix(self) -> str:
        """The cloud's endpoint suffix (core.windows.net, core.chinacloudapi.cn, ...)."""
        return self.host.partition(".")[2].partition(".")[2] or "core.windows.net"


def parse_azure_url(url: str) -> AzureLocation:
    """az://container/prefix, az://container@account/prefix, abfs[s]://container@account.dfs.SUFFIX/prefix."""
    scheme, _, rest = url.partition("://")
    netloc, _, prefix = rest.partition("/")
    container, at, host = netloc.partition("@")
    account, _, domain = host.partition(".")
    if at and not account:
        raise UsageError(f"{url}: no account after '@'")
    if domain and (domain.partition(".")[0] not in ("blob", "dfs") or not domain.partition(".")[2]):
        raise UsageError(
            f"{url}: expected container@ACCOUNT.blob.core.windows.net or "
            f"container@ACCOUNT.dfs.core.windows.net, got the host {host!r}"
        )
    if not CONTAINER_NAME.fullmatch(container):
        raise UsageError(
            f"{url}: {container!r} is not a container name (3-63 lower-case letters, digits and single hyphens)"
        )
    return AzureLocation(scheme.lower(), container, prefix.strip("/"), host)


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def connection_string_account(connection_string: str) -> str | None:
    parts = dict(p.split("=", 1) for p in connection_string.split(";") if "=" in p)
    return parts.get("AccountName")


def account_of(where: AzureLocation) -> str | None:
    """The account the credentials will reach (None: the connection string's endpoint decides);
    a UsageError when there is none or the URL and the connection string disagree. No request."""
    connection_string = _env("AZURE_STORAGE_CONNECTION_STRING")
    if connection_string:
        named = connection_string_account(connection_string)
        if where.account and named and where.account != named:
            raise UsageError(
                f"the URL names the account {where.account!r} but AZURE_STORAGE_CONNECTION_STRING is for {named!r}"
            )
        return named
    account = where.account or _env("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")
    if not account:
        raise UsageError(
            f"{where.scheme}://{where.container}: no Azure storage account: name it in the URL "
            f"({where.scheme}://{where.container}@ACCOUNT.dfs.core.windows.net/...), or set "
            "AZURE_STORAGE_ACCOUNT_NAME or AZURE_STORAGE_CONNECTION_STRING"
        )
    return account


def service_client(where: AzureLocation, **options) -> BlobServiceClient:
    """A client from the standard credential chain (module docstring); nothing secret is kept."""
    account = account_of(where)
    connection_string = _env("AZURE_STORAGE_CONNECTION_STRING")
    if connection_string:
        try:
            return BlobServiceClient.from_connection_string(connection_string, **options)
        except ValueError:
            raise UsageError(
                "AZURE_STORAGE_CONNECTION_STRING is malformed (expected "
                "AccountName=...;AccountKey=...; or a SAS and BlobEndpoint)"
            ) from None
    key = _env("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY")
    sas = _env("AZURE_STORAGE_SAS_TOKEN")
    if key:
        credential = {"account_name": account, "account_key": key}
    elif sas:
        from azure.core.credentials import AzureSasCredential

        credential = AzureSasCredential(sas.lstrip("?"))
    else:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return BlobServiceClient(f"https://{account}.blob.{where.suffix}", credential=credential, **options)


class _BoundedRetry(ExponentialRetry):
    """The SDK's retry (throttling, 5xx, resets, timeouts), with a log line per failed attempt and
    no retry after the enclosing operation's deadline (or the request's own)."""

    def __init__(self, deadline_s: float, **options):
        super().__init__(**options)
        self.deadline_s = deadline_s

    def configure_retries(self, request):
        settings = super().configure_retries(request)
        enclosing = current_operation()
        settings["vitforge_deadline"] = enclosing.deadline if enclosing else time.monotonic() + self.deadline_s
        return settings

    def increment(self, settings, request, response=None, error=None) -> bool:
        retrying = super().increment(settings, request, response, error)
        failure = type(error).__name__ if error is not None else f"{response.status_code} {response.reason}"
        where = f"{request.method} {request.url.split('?', 1)[0]}"  # the query may hold a SAS token
        attempts = settings["count"] + (0 if retrying else 1)
        if time.monotonic() >= settings["vitforge_deadline"]:
            raise past_deadline(where, attempts, failure)
        if retrying:
            log.warning(
                "%s: attempt %d/%d failed: %s; %.1f s left before the deadline",
                where,
                attempts,
                self.total_retries + 1,
                failure,
                settings["vitforge_deadline"] - time.monotonic(),
            )
        return retrying


def client_options() -> dict:
    """The SDK's retry within retry.py's bounds, its per-attempt timeouts, and a pool of 32
    connections (requests' default of 10 would drop connections under parallel parts)."""
    import requests
    import requests.adapters

    limits = store_limits()
    retry = _BoundedRetry(
        limits.deadline_s,
        initial_backoff=0.5,
        increment_base=1.5,
        random_jitter_range=0.5,
        retry_total=limits.attempts - 1,
    )
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=32, pool_maxsize=32)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    # 256 KiB reads, as the SDK's own transport does: azure-core's default of 4 KiB halves download speed
    transport = RequestsTransport(
        session=session,
        session_owner=False,
        connection_timeout=limits.connect_timeout_s,
        read_timeout=limits.read_timeout_s,
        connection_data_block_size=256 << 10,
    )
    return {
        "retry_policy": retry,
        "transport": transport,
        "max_single_put_size": SINGLE_PUT_BYTES,
        "max_block_size": BLOCK_BYTES,
    }


def _first_line(e: AzureError) -> str:
    """The error's first line, any URL query cut out: with SAS credentials it holds the signature."""
    return re.sub(r"\?\S*", "", (str(e.message or e).strip().splitlines() or [""])[0])


def _code(e: HttpResponseError) -> str:
    """ "412 ConditionNotMet": the status and Azure's error code (an enum or a string)."""
    return f"{e.status_code} {getattr(e.error_code, 'value', e.error_code) or ''}".strip()


def _denied(url: str, cause: str, e: AzureError) -> StorageError:
    return StorageError(
        f"{url}: access denied ({cause}: {_first_line(e)}); credentials come from "
        "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN or "
        "DefaultAzureCredential"
    )


@contextlib.contextmanager
def _named(url: str, create: bool = False):
    """The SDK's errors are many lines naming the endpoint: say which URL failed, and why, in one
    line, without any credential. `create`: a conflict means the blob exists (conditional create)."""
    try:
        yield
    except ClientAuthenticationError as e:  # a key that cannot sign, or no credential found
        raise _denied(url, _code(e) if e.status_code else "no usable credential", e) from None
    except ResourceNotFoundError as e:
        if _code(e).endswith("ContainerNotFound"):
            raise StorageError(f"{url}: the container does not exist") from None
        raise FileNotFoundError(f"{url}: no such object") from None
    except ResourceModifiedError:
        raise PreconditionFailed(f"{url}: changed by another writer") from None
    except ResourceExistsError as e:
        if create:  # Azure answers If-None-Match "*" on an existing blob with 409 (or 412)
            raise PreconditionFailed(f"{url}: created by another writer") from None
        raise StorageError(f"{url}: {_code(e)}: {_first_line(e)}") from None
    except (IncompleteReadError, ServiceResponseError) as e:
        raise TransientError(f"{url}: {type(e).__name__}: {_first_line(e)}") from None  # a body cut short
    except HttpResponseError as e:
        if e.status_code in (401, 403):
            raise _denied(url, _code(e), e) from None
        if e.status_code == 412:
            raise PreconditionFailed(f"{url}: changed by another writer") from None
        if e.status_code in (429, 500, 502, 503, 504):  # only once the SDK's own retries are spent
            raise TransientError(f"{url}: {_code(e)}: {_first_line(e)}") from None
        raise StorageError(f"{url}: {_code(e)}: {_first_line(e)}") from None
    except ServiceRequestError as e:
        raise StorageError(
            f"{url}: cannot reach the blob endpoint: {_first_line(e)} (after the SDK's retries)"
        ) from None
    except AzureError as e:
        raise StorageError(f"{url}: {type(e).__name__}: {_first_line(e)}") from None


def open_azure(url: str, work_dir: str) -> AzureStore:
    """The client itself is made on first use (after a fork, in the process that uses it); a
    missing account is refused here, before any retry."""
    where = parse_azure_url(url)
    account_of(where)
    return AzureStore(where)


@dataclass
class AzureStore(StagedStore):
    """Per rank: one client and its pool of 32 connections; an upload holds at most UPLOAD_THREADS
    blocks (BLOCK_BYTES each) in memory. `requests`: HTTP requests sent, the SDK's retries included."""

    where: AzureLocation
    _container: object = field(default=None, repr=False)

    _client_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def container(self):
        """One client per store: a download's parallel parts would otherwise each build one (and
        each ask DefaultAzureCredential for a token)."""
        with self._client_lock:
            if self._container is None:
                client = service_client(self.where, **client_options(), raw_request_hook=self.count_request)
                self._container = client.get_container_client(self.where.container)
        return self._container

    def blob(self, name: str):
        return self.container.get_blob_client(self.key(name))

    def staging_key(self, name: str) -> str:
        return f"{self.where.container}/{self.key(name)}"

    def key(self, name: str) -> str:
        return f"{self.where.prefix}/{name}".strip("/") if self.where.prefix else name

    def url(self, name: str) -> str:
        host = f"@{self.where.host}" if self.where.host else ""
        return f"{self.where.scheme}://{self.where.container}{host}/{self.key(name)}"

    def put_file(self, local_path: str, name: str, keep: bool = False) -> None:
        """Blocks staged in parallel (UPLOAD_THREADS), then one commit: the blob appears whole or not at all."""
        with open(local_path, "rb") as f, _named(self.url(name)):
            self.blob(name).upload_blob(
                f, length=os.fstat(f.fileno()).st_size, overwrite=True, max_concurrency=UPLOAD_THREADS
            )
        if not keep:
            os.unlink(local_path)

    def put_bytes(self, name: str, data: bytes) -> None:
        with _named(self.url(name)):
            self.blob(name).upload_blob(data, overwrite=True)

    def get_bytes(self, name: str) -> bytes:
        return self._read(name, None, None, None)

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        def fetch():
            with _named(self.url(name)):
                stream = self.blob(name).download_blob()
                return stream.readall(), stream.properties.etag

        return with_retries_if_present(fetch, f"get {self.url(name)}")

    def put_if(self, name: str, data: bytes, version: str | None) -> str:
        """If-None-Match "*" when absent, If-Match ETag otherwise; the new ETag."""
        condition = (
            {"overwrite": False}
            if version is None
            else {"overwrite": True, "etag": version, "match_condition": MatchConditions.IfNotModified}
        )
        with _named(self.url(name), create=version is None):
            return self.blob(name).upload_blob(data, **condition)["etag"]

    def stat(self, name: str) -> ObjectInfo:
        with _named(self.url(name)):
            properties = self.blob(name).get_blob_properties()
        return ObjectInfo(properties.size, properties.etag)

    def get_range(self, name: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes [start, end) in one ranged read, of `version` when given; a body cut short is read again."""
        return self._read(name, start, end - start, version) if end > start else b""

    def _read(self, name: str, offset: int | None, length: int | None, version: str | None) -> bytes:
        url = self.url(name)
        pin = {"etag": version, "match_condition": MatchConditions.IfNotModified} if version else {}

        def fetch() -> bytes:
            with _named(url):
                stream = self.blob(name).download_blob(offset=offset, length=length, **pin)
                body = stream.readall()
            return whole(body, stream.size if length is None else length, offset or 0)

        return with_retries(fetch, f"get {url}")

    def list_folder(self, prefix: str) -> tuple[list[str], dict[str, int]]:
        """One "/"-delimited level, page by page."""
        base = self.folder_key(prefix)
        folders, files = [], {}
        with _named(self.url(prefix)):
            for item in self.container.walk_blobs(
                name_starts_with=base or None, delimiter="/", results_per_page=LIST_PAGE
            ):
                if isinstance(item, BlobPrefix):
                    folders.append(item.name[len(base) :].rstrip("/"))
                elif not item.name.endswith("/"):  # a folder marker, not an object
                    files[item.name[len(base) :]] = item.size
        return folders, files

    def walk(self, prefix: str = "") -> dict[str, int]:
        base, outer = self.folder_key(prefix), f"{prefix.rstrip('/')}/" if prefix else ""
        with _named(self.url(prefix)):
            return {
                outer + b.name[len(base) :]: b.size
                for b in self.container.list_blobs(name_starts_with=base or None, results_per_page=LIST_PAGE)
            }

    def delete(self, names: list[str]) -> None:
        """Batches of 256 (Azure's most per batch); absent blobs are not an error."""
        for start in range(0, len(names), 256):
            chunk = names[start : start + 256]
            with _named(self.url(chunk[0])):
                answers = self.container.delete_blobs(*(self.key(n) for n in chunk), raise_on_any_failure=False)
            failed = [(n, a.status_code) for n, a in zip(chunk, answers) if a.status_code not in (202, 404)]
            if failed:
                raise StorageError(
                    f"{self.url(failed[0][0])}: delete refused ({failed[0][1]}); "
                    f"{len(failed)} of {len(chunk)} blobs not deleted"
                )

    def abort_uploads(self, prefix: str) -> int:
        """Nothing to do, and 0: blocks staged by a dead writer are never visible, are not listed,
        and Azure discards uncommitted blocks after 7 days by itself (there is no call to drop them
        sooner without committing them)."""
        return 0
