"""The S3 backend of the object store: adapters as key prefixes in one S3 (or S3-compatible)
bucket, through boto3 (imported only when a store opens, so nothing else needs it installed).

Every botocore failure becomes the :class:`~loraplex.cache.store.StoreError` subclass that says
what happened (:meth:`S3Store._error`): not found, access denied, endpoint down or the object
changed mid-download.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from loraplex.cache.store import FetchResult, StoreBase, StoreEntry, fetch_files, files_to_put
from loraplex.lora.peft.files import (
    ADAPTER_FILES,
    BIN_NAME,
    CONFIG_NAME,
    SAFETENSORS_NAME,
    choose_adapter_files,
)
from loraplex.types import (
    StoreError,
    StoreNotFoundError,
    StorePermissionError,
    StoreUnavailableError,
)

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


class S3Store(StoreBase):
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

        nbytes = fetch_files(Path(dest), entry.files, download_one)
        return FetchResult(
            entry.uri, Path(dest), tuple(entry.files), nbytes, time.perf_counter() - t0,
            "|".join(etags),
        )  # fmt: skip

    def put_dir(self, src: Path, uri: str) -> None:
        src = Path(src)
        writes, stale = files_to_put(src)
        key_dir = self._key_dir(uri)
        for n in writes:
            with open(src / n, "rb") as f:
                self._call(
                    uri,
                    "uploading",
                    self._client.put_object,
                    Bucket=self.bucket,
                    Key=key_dir + n,
                    Body=f,
                )
        for n in stale:
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
