"""Object stores (the L3 tier): where adapter directories live as the source of truth.

One small protocol, :class:`ObjectStore`, with two backends chosen once at start-up by
:func:`open_store`: :class:`LocalDirStore` (a directory tree) and :class:`S3Store` (S3 or any
S3-compatible service through boto3). A store only moves bytes: it fetches an adapter
directory's known files (``adapter_config.json`` plus ``adapter_model.safetensors`` or, failing
that, ``adapter_model.bin``), reports a cheap change fingerprint, uploads, deletes and lists.
It never decides what to cache or evict, and it does not verify digests (see ``verify.py``).

Every failure is a :class:`StoreError` (an :class:`AdapterError`) whose message names the store,
the URI and the cause; subclasses tell "not there" from "not allowed" from "store down".

This module imports neither torch nor boto3 at import time (boto3 only when an S3 store opens).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from loraplex.lora.peft_format import (
    ADAPTER_FILES,
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_NAME,
    choose_adapter_files,
)
from loraplex.paths import contained
from loraplex.types import (  # defined at the types layer; re-exported for the cache's users
    StoreError,
    StoreNotFoundError,
    StorePermissionError,
    StoreUnavailableError,
)

STAGE_REMOTE_DOWNLOAD = "remote_download"


@dataclass(frozen=True)
class StoreEntry:
    """What a store holds for one adapter: the files fetch would download and their sizes."""

    uri: str
    files: dict[str, int]  # file name -> size in bytes (config + chosen weights file)
    fingerprint: str

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


@dataclass(frozen=True)
class FetchResult:
    """One download of an adapter directory into ``dest`` (the ``remote_download`` stage)."""

    uri: str
    dest: Path
    files: tuple[str, ...]
    nbytes: int
    seconds: float
    fingerprint: str  # of the objects actually downloaded
    stage: str = field(default=STAGE_REMOTE_DOWNLOAD)


@runtime_checkable
class ObjectStore(Protocol):
    """Where adapters come from. URIs are full (``file://``, ``s3://``) or relative to the root."""

    def describe(self) -> str:
        """Human-readable identity of the store, for errors and metrics."""
        ...

    def uri(self, name: str) -> str:
        """The full URI of the adapter directory ``name`` (relative to the store's root)."""
        ...

    def stat(self, uri: str) -> StoreEntry:
        """Files and sizes of one adapter; :class:`StoreNotFoundError` if it is not complete."""
        ...

    def fingerprint(self, uri: str) -> str:
        """Cheap change detector (sizes + mtimes locally, sizes + ETags on S3)."""
        ...

    def exists(self, uri: str) -> bool:
        """Whether a complete adapter (config + weights) is at ``uri``."""
        ...

    def fetch(self, uri: str, dest: Path) -> FetchResult:
        """Download the adapter's files into ``dest`` (created if needed); nothing left on error."""
        ...

    def put_dir(self, src: Path, uri: str) -> None:
        """Upload the adapter files of ``src`` to ``uri``, replacing what was there."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the adapter files at ``uri`` (no error if they are already gone)."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Full URIs of the adapter directories under ``prefix`` (relative to the root), sorted."""
        ...


def _local_files(src: Path) -> list[str]:
    """Known adapter file names present (as regular files) in a local directory."""
    return [n for n in ADAPTER_FILES if (src / n).is_file()]


def _fetch_files(dest: Path, files: Sequence[str], copy_one: Callable[[str, Path], int]) -> int:
    """Copy every file of an adapter into ``dest`` with ``copy_one(name, target) -> bytes``; on
    any failure the files written so far (and ``dest``, if this call created it) are removed
    before the error propagates. Returns the bytes written."""
    created = _prepare_dest(dest)
    written: list[str] = []
    try:
        total = 0
        for name in files:
            written.append(name)
            total += copy_one(name, dest / name)
        return total
    except BaseException:
        _remove_files(dest, written, created)
        raise


def _remove_files(dest: Path, names: Iterable[str], created_dest: bool) -> None:
    """Undo a failed fetch: drop the files it wrote (and ``dest`` if the fetch created it)."""
    for n in names:
        (dest / n).unlink(missing_ok=True)
    if created_dest:
        shutil.rmtree(dest, ignore_errors=True)


def _prepare_dest(dest: Path) -> bool:
    """Create ``dest`` if missing; returns whether it was created (so a failure can remove it)."""
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir():
            raise StoreError(f"fetch destination {dest} is not a directory")
        return False
    dest.mkdir(parents=True)
    return True


class _StoreBase:
    """What every store derives from :meth:`stat`."""

    def stat(self, uri: str) -> StoreEntry:
        raise NotImplementedError

    def fingerprint(self, uri: str) -> str:
        return self.stat(uri).fingerprint

    def exists(self, uri: str) -> bool:
        try:
            self.stat(uri)
        except StoreNotFoundError:
            return False
        return True


class LocalDirStore(_StoreBase):
    """Adapters as directories under ``root``; nothing outside ``root`` is ever read or written.

    URIs are paths relative to ``root``, absolute paths inside it, or ``file://`` URLs of those.
    Any ``..`` component is refused, and so is anything (including a symlinked file) that
    resolves outside ``root``.
    """

    def __init__(self, root: str | Path) -> None:
        root_path = Path(root).expanduser()
        if not root_path.is_dir():
            raise StoreNotFoundError(
                f"local store root {root_path} does not exist or is not a directory",
                store=f"local dir {root_path}",
            )
        self.root = root_path.resolve()

    def describe(self) -> str:
        return f"local dir {self.root}"

    def uri(self, name: str) -> str:
        return self._dir(name).as_uri()

    # -- resolution ------------------------------------------------------------------------------
    def _refuse(self, uri: str, why: str) -> StorePermissionError:
        return StorePermissionError(
            f"{self.describe()}: refused adapter URI {uri!r}: {why}", store=self.describe(), uri=uri
        )

    def _contained(self, p: Path) -> bool:
        """Strictly inside the root (the root itself is no adapter directory)."""
        return p != self.root and contained(p, (self.root,))

    def _dir(self, uri: str) -> Path:
        """Resolved adapter directory for ``uri``, checked to lie strictly inside the root."""
        uri = os.fspath(uri)
        if uri.startswith("file://"):
            parsed = urlparse(uri)
            if parsed.netloc not in ("", "localhost"):
                raise self._refuse(uri, f"file URL with host {parsed.netloc!r}")
            raw = Path(unquote(parsed.path))
        elif "://" in uri:
            raise self._refuse(uri, "not a local path or file:// URL")
        else:
            raw = Path(uri)
        if not str(raw) or str(raw) == ".":
            raise self._refuse(uri, "empty adapter path")
        if ".." in raw.parts:
            raise self._refuse(uri, "'..' components are not allowed")
        full = (raw if raw.is_absolute() else self.root / raw).resolve()
        if not self._contained(full):
            raise self._refuse(uri, f"resolves to {full}, outside the store root {self.root}")
        return full

    def _file(self, uri: str, d: Path, name: str) -> Path:
        """One adapter file, refused if it is a symlink leading outside the root."""
        p = (d / name).resolve()
        if not self._contained(p):
            raise self._refuse(uri, f"{name} resolves to {p}, outside the store root {self.root}")
        return p

    # -- protocol --------------------------------------------------------------------------------
    def stat(self, uri: str) -> StoreEntry:
        d = self._dir(uri)
        names = choose_adapter_files(_local_files(d)) if d.is_dir() else ()
        if len(names) < 2:
            if not d.is_dir():
                what = "no adapter directory"
            elif not names:
                what = f"missing {CONFIG_NAME}"
            else:
                what = f"missing weights ({SAFETENSORS_NAME} or {BIN_NAME})"
            raise StoreNotFoundError(
                f"{self.describe()}: {what} at {uri!r} ({d})", store=self.describe(), uri=uri
            )
        files: dict[str, int] = {}
        parts = []
        for n in names:
            st = self._file(uri, d, n).stat()
            files[n] = st.st_size
            parts.append(f"{n}:{st.st_size}:{st.st_mtime_ns}")
        return StoreEntry(d.as_uri(), files, "|".join(parts))

    def fetch(self, uri: str, dest: Path) -> FetchResult:
        t0 = time.perf_counter()
        entry = self.stat(uri)
        d = self._dir(uri)

        def copy_one(name: str, target: Path) -> int:
            try:
                shutil.copyfile(self._file(uri, d, name), target)
                return target.stat().st_size
            except OSError as e:
                raise StoreError(
                    f"{self.describe()}: cannot copy {uri!r} to {target.parent}: {e}",
                    store=self.describe(),
                    uri=uri,
                ) from e

        nbytes = _fetch_files(Path(dest), entry.files, copy_one)
        return FetchResult(
            entry.uri, Path(dest), tuple(entry.files), nbytes, time.perf_counter() - t0,
            entry.fingerprint,
        )  # fmt: skip

    def put_dir(self, src: Path, uri: str) -> None:
        src = Path(src)
        names = _local_files(src)
        if CONFIG_NAME not in names or len(names) < 2:
            raise StoreError(f"{src} is not an adapter directory (needs config + weights)")
        d = self._dir(uri)
        try:
            d.mkdir(parents=True, exist_ok=True)
            # Weights first, config last: a reader never sees a config without its weights.
            for n in sorted(names, key=lambda n: n == CONFIG_NAME):
                tmp = d / f".{n}.{uuid.uuid4().hex}.tmp"
                try:
                    shutil.copyfile(src / n, tmp)
                    os.replace(tmp, d / n)
                finally:
                    tmp.unlink(missing_ok=True)
            for n in ADAPTER_FILES:
                if n not in names:
                    (d / n).unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(
                f"{self.describe()}: cannot write {uri!r}: {e}", store=self.describe(), uri=uri
            ) from e

    def delete(self, uri: str) -> None:
        d = self._dir(uri)
        for n in ADAPTER_FILES:
            (d / n).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass  # missing, or holds other files: not ours to remove

    def list(self, prefix: str = "") -> list[str]:
        base = self._dir(prefix) if prefix else self.root
        out = []
        for dirpath, _dirs, files in os.walk(base):  # followlinks=False: stays inside the root
            if CONFIG_NAME in files:
                out.append(Path(dirpath).as_uri())
        return sorted(out)


# -- S3 ------------------------------------------------------------------------------------------

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchBucket"})
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
    }
)
_UNAVAILABLE_CODES = frozenset(
    {"ServiceUnavailable", "SlowDown", "InternalError", "503", "500", "RequestTimeout"}
)


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError as e:
        raise StoreError(
            "S3 object stores need boto3, which is not installed: pip install 'loraplex[s3]' "
            "(or pip install boto3)"
        ) from e
    return boto3


class S3Store(_StoreBase):
    """Adapters as key prefixes ``<prefix><name>/`` in one S3 (or S3-compatible) bucket.

    Credentials come from the usual AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
    profiles, instance roles); ``endpoint_url`` from the argument or ``AWS_ENDPOINT_URL``. Only
    URIs inside ``s3://bucket/prefix/`` are accepted. Timeouts and retries are small so that a
    store that is down fails within a few seconds instead of stalling the loads behind it.
    ``client_kwargs`` go to ``session.client("s3", ...)`` (e.g. explicit credentials).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        connect_timeout: float = 1.5,
        read_timeout: float = 20.0,
        max_attempts: int = 3,
        addressing_style: str | None = None,
        chunk_bytes: int = 8 << 20,
        session: Any = None,
        **client_kwargs: Any,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"S3Store: invalid bucket name {bucket!r}")
        parts = [p for p in prefix.strip("/").split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"S3Store: invalid prefix {prefix!r}")
        self.bucket = bucket
        self.prefix = "".join(f"{p}/" for p in parts)  # "" or "a/b/"
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self.chunk_bytes = chunk_bytes
        boto3 = _import_boto3()
        from botocore.config import Config

        style = addressing_style or ("path" if self.endpoint_url else "auto")
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": style},
        )
        # Own session (the default one is not thread-safe), unless the caller shares one to
        # skip re-loading botocore's service models for every store it opens.
        session = session or boto3.session.Session()
        self._client = session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region,
            config=config,
            **client_kwargs,
        )

    def describe(self) -> str:
        where = self.endpoint_url or "the default AWS endpoint"
        return f"S3 store s3://{self.bucket}/{self.prefix} at {where}"

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key_dir(name)}"

    # -- resolution and errors --------------------------------------------------------------------
    def _refuse(self, uri: str, why: str) -> StorePermissionError:
        return StorePermissionError(
            f"{self.describe()}: refused adapter URI {uri!r}: {why}", store=self.describe(), uri=uri
        )

    def _key_dir(self, uri: str) -> str:
        """``<prefix><name>/`` for a full ``s3://`` URI in our bucket/prefix or a relative name."""
        if uri.startswith("s3://"):
            bucket, _, key = uri[len("s3://") :].partition("/")
            if bucket != self.bucket:
                raise self._refuse(uri, f"bucket {bucket!r} is not the store's bucket")
        elif "://" in uri:
            raise self._refuse(uri, "not an s3:// URI")
        else:
            key = self.prefix + uri.lstrip("/")
        parts = key.rstrip("/").split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise self._refuse(uri, "empty, '.' or '..' path segments are not allowed")
        key_dir = "/".join(parts) + "/"
        if not key_dir.startswith(self.prefix) or key_dir == self.prefix:
            raise self._refuse(uri, f"not under the store's prefix {self.prefix!r}")
        return key_dir

    def _error(self, e: Exception, uri: str, doing: str) -> StoreError:
        """Map a botocore exception to the StoreError subclass whose message says what happened."""
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            IncompleteReadError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        store = self.describe()
        endpoint = self.endpoint_url or self._client.meta.endpoint_url
        head = f"{store}: {doing} {uri}"
        if isinstance(e, (EndpointConnectionError, ConnectTimeoutError)):
            return StoreUnavailableError(
                f"{head}: S3 endpoint {endpoint} unreachable ({e})", store=store, uri=uri
            )
        dropped = (
            ReadTimeoutError,
            ConnectionClosedError,
            ResponseStreamingError,
            IncompleteReadError,
        )
        if isinstance(e, dropped):
            return StoreUnavailableError(
                f"{head}: S3 endpoint {endpoint} timed out or dropped the connection ({e})",
                store=store,
                uri=uri,
            )
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StorePermissionError(
                f"{head}: no usable AWS credentials ({e}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or configure a profile",
                store=store,
                uri=uri,
            )
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", "?"))
            msg = err.get("Message") or ""
            if code == "NoSuchBucket":
                return StoreNotFoundError(
                    f"{head}: no such bucket {self.bucket!r}", store=store, uri=uri
                )
            if code in _NOT_FOUND_CODES:
                return StoreNotFoundError(f"{head}: no such key ({code})", store=store, uri=uri)
            if code in _DENIED_CODES:
                return StorePermissionError(
                    f"{head}: access denied ({code}{': ' + msg if msg else ''})",
                    store=store,
                    uri=uri,
                )
            if code in ("PreconditionFailed", "412"):
                return StoreError(
                    f"{head}: the object changed while it was being downloaded; retry",
                    store=store,
                    uri=uri,
                )
            if code in _UNAVAILABLE_CODES:
                return StoreUnavailableError(
                    f"{head}: S3 endpoint {endpoint} unavailable ({code})", store=store, uri=uri
                )
            return StoreError(f"{head}: S3 error {code}: {msg or e}", store=store, uri=uri)
        return StoreError(f"{head}: {type(e).__name__}: {e}", store=store, uri=uri)

    def _call(self, uri: str, doing: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, uri, doing) from e

    # -- protocol --------------------------------------------------------------------------------
    def _listing(self, uri: str, key_dir: str) -> dict[str, dict]:
        """Known adapter files directly under ``key_dir``: name -> {Key, Size, ETag}."""
        resp = self._call(
            uri,
            "listing",
            self._client.list_objects_v2,
            Bucket=self.bucket,
            Prefix=key_dir,
            Delimiter="/",
        )
        out = {}
        for obj in resp.get("Contents", []):
            name = obj["Key"][len(key_dir) :]
            if name in ADAPTER_FILES:
                out[name] = obj
        return out

    def stat(self, uri: str) -> StoreEntry:
        return self._stat(uri)[0]

    def _stat(self, uri: str) -> tuple[StoreEntry, dict[str, dict]]:
        key_dir = self._key_dir(uri)
        full = f"s3://{self.bucket}/{key_dir}"
        listing = self._listing(full, key_dir)
        names = choose_adapter_files(listing)
        if len(names) < 2:
            missing = CONFIG_NAME if not names else f"{SAFETENSORS_NAME} or {BIN_NAME}"
            raise StoreNotFoundError(
                f"{self.describe()}: no such key {full}{missing}"
                + ("" if not names else " (adapter has a config but no weights)"),
                store=self.describe(),
                uri=uri,
            )
        files = {n: int(listing[n]["Size"]) for n in names}
        fp = "|".join(f"{n}:{listing[n]['Size']}:{listing[n]['ETag']}" for n in names)
        return StoreEntry(full, files, fp), listing

    def fetch(self, uri: str, dest: Path) -> FetchResult:
        t0 = time.perf_counter()
        key_dir = self._key_dir(uri)
        entry, listing = self._stat(uri)
        etags = []
        from botocore.exceptions import BotoCoreError, ClientError

        def download_one(name: str, target: Path) -> int:
            key = key_dir + name
            # IfMatch: the bytes we get are the version the listing (fingerprint) saw.
            resp = self._call(
                f"s3://{self.bucket}/{key}",
                "downloading",
                self._client.get_object,
                Bucket=self.bucket,
                Key=key,
                IfMatch=listing[name]["ETag"],
            )
            etags.append(f"{name}:{resp.get('ContentLength')}:{resp.get('ETag')}")
            nbytes = 0
            try:
                with open(target, "wb") as f:
                    for chunk in resp["Body"].iter_chunks(self.chunk_bytes):
                        f.write(chunk)
                        nbytes += len(chunk)
            except (BotoCoreError, ClientError) as e:
                raise self._error(e, f"s3://{self.bucket}/{key}", "downloading") from e
            except OSError as e:
                raise StoreError(
                    f"{self.describe()}: cannot write {target} while downloading {uri}: {e}",
                    store=self.describe(),
                    uri=uri,
                ) from e
            return nbytes

        nbytes = _fetch_files(Path(dest), entry.files, download_one)
        return FetchResult(
            entry.uri, Path(dest), tuple(entry.files), nbytes, time.perf_counter() - t0,
            "|".join(etags),
        )  # fmt: skip

    def put_dir(self, src: Path, uri: str) -> None:
        src = Path(src)
        names = _local_files(src)
        if CONFIG_NAME not in names or len(names) < 2:
            raise StoreError(f"{src} is not an adapter directory (needs config + weights)")
        key_dir = self._key_dir(uri)
        # Weights first, config last: a reader that sees the config also sees the weights.
        for n in sorted(names, key=lambda n: n == CONFIG_NAME):
            with open(src / n, "rb") as f:
                self._call(
                    uri,
                    "uploading",
                    self._client.put_object,
                    Bucket=self.bucket,
                    Key=key_dir + n,
                    Body=f,
                )
        for n in ADAPTER_FILES:
            if n not in names:
                self._call(
                    uri, "deleting", self._client.delete_object, Bucket=self.bucket, Key=key_dir + n
                )

    def delete(self, uri: str) -> None:
        key_dir = self._key_dir(uri)
        # Config first: the adapter disappears as a whole before its weights do.
        for n in ADAPTER_FILES:
            self._call(
                uri, "deleting", self._client.delete_object, Bucket=self.bucket, Key=key_dir + n
            )

    def list(self, prefix: str = "") -> list[str]:
        base = self.prefix
        if prefix:
            base = self._key_dir(prefix)
        root_uri = f"s3://{self.bucket}/{base}"
        out = []
        token: dict[str, str] = {}
        while True:
            resp = self._call(
                root_uri,
                "listing",
                self._client.list_objects_v2,
                Bucket=self.bucket,
                Prefix=base,
                **token,
            )
            for obj in resp.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/" + CONFIG_NAME):
                    out.append(f"s3://{self.bucket}/{key[: -len(CONFIG_NAME)]}")
            if not resp.get("IsTruncated"):
                break
            token = {"ContinuationToken": resp["NextContinuationToken"]}
        return sorted(out)


def open_store(url: str | Path, **options: Any) -> ObjectStore:
    """The store for ``url``: a path or ``file://`` URL → :class:`LocalDirStore`;
    ``s3://bucket[/prefix]`` → :class:`S3Store` (``options`` go to its constructor).

    Anything else raises ``ValueError`` naming the scheme.
    """
    if isinstance(url, Path):
        return LocalDirStore(url, **options)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"S3 store URL {url!r} has no bucket (expected s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path, **options)
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {url!r} names a host; only local paths are supported")
        return LocalDirStore(Path(unquote(parsed.path)), **options)
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):  # plain path (or C:\ on Windows)
        return LocalDirStore(Path(url), **options)
    raise ValueError(
        f"unsupported object store scheme {scheme!r} in {url!r} (supported: a path, file://, s3://)"
    )
