"""A local copy of a set of API objects kept current by one LIST and then a WATCH.

Readers ask the copy, not the API server, so how often they look costs no traffic. The
first LIST asks for resourceVersion=0 (the apiserver's watch cache answers it, etcd is not
read), as client-go's informers do. The watch resumes from the last resourceVersion it saw
(bookmarks keep that fresh) and lists again, then from etcd, only when the server no longer
has that version (410 Gone). A watch that fails or ends early is reopened after a growing,
jittered delay (watch_pacing). A resource whose type is not installed (404, e.g. the CRD is
absent) reads as empty and is looked for again later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi, WatchStream
from flexgpu.kubelet_plugin.api.watch_pacing import WatchPacer

log = logging.getLogger(__name__)

ABSENT_RECHECK_S = 60.0
WATCH_TIMEOUT_S = 300


class WatchedObjects:
    def __init__(
        self,
        api: KubeApi,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        on_change: Callable[[], None] = lambda: None,
        name: str = "",
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        pacer: WatchPacer | None = None,
        keep: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> None:
        self._api = api
        self._path = path
        self._query = dict(query or {})
        self._on_change = on_change
        self.name = name or path
        self._watch_timeout_s = watch_timeout_s
        self._pacer = pacer or WatchPacer()
        # Objects this returns False for are not kept (a watch of a whole resource that needs
        # few of its objects); one that stops matching leaves the copy as if deleted.
        self._keep = keep or (lambda _: True)
        self._objects: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self.lists = 0  # full LISTs done, for tests
        self.last_error: str | None = None

    # -- readers ---------------------------------------------------------------------------
    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._objects.values())

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    @property
    def synced(self) -> bool:
        """True once the copy has been filled by a first LIST (or the type is absent)."""
        return self._synced.is_set()

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        return self._synced.wait(timeout_s)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread:
            self._thread.join(timeout=5)

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        pacer = self._pacer
        version: str | None = None
        from_cache = True  # the first list; after a 410 the cache may be as old as we are
        while not self._stop.is_set():
            pacer.opened()
            try:
                if version is None:
                    version = self._list(from_cache)
                version = self._watch(version)
                self.last_error = None
                delay = pacer.ended()
                if delay:
                    log.info("watch of %s ended early, reopening in %.1fs", self.name, delay)
            except ApiError as err:
                if err.status == 410:  # our version is too old: list again
                    version, from_cache = None, False
                    delay = pacer.ended()
                elif err.status == 404:
                    self._absent()
                    version = None
                    delay = ABSENT_RECHECK_S
                else:
                    version = None if err.status >= 500 else version
                    delay = self._failed(err, pacer.failed(err.retry_after_s))
            except Exception as err:  # connection trouble: retry, never die
                delay = self._failed(err, pacer.failed())
            if delay and self._stop.wait(delay):
                return

    def _failed(self, err: Exception, delay: float) -> float:
        self.last_error = str(err)
        if not self._stop.is_set():
            log.warning("watch of %s failed, retrying in %.1fs: %s", self.name, delay, err)
        return delay

    def _list(self, from_cache: bool) -> str:
        query = {**self._query, "resourceVersion": "0"} if from_cache else self._query
        listed = self._api.get(self._path, query)
        self.lists += 1
        objects = {_name(o): o for o in listed.get("items") or [] if self._keep(o)}
        with self._lock:
            changed = objects != self._objects
            self._objects = objects
        self._synced.set()
        if changed or self.lists == 1:
            self._on_change()
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    def _absent(self) -> None:
        with self._lock:
            changed = bool(self._objects)
            self._objects = {}
        first = not self._synced.is_set()
        self._synced.set()
        if changed or first:
            self._on_change()

    def _watch(self, version: str) -> str:
        query = {**self._query, "resourceVersion": version, "allowWatchBookmarks": "true"}
        stream = self._api.watch(self._path, query, self._watch_timeout_s)
        self._stream = stream
        try:
            if self._stop.is_set():
                return version
            for kind, obj in stream:
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    if kind == "DELETED" or not self._keep(obj):
                        if self._objects.pop(_name(obj), None) is None:
                            continue  # never kept: nothing changed
                    else:
                        self._objects[_name(obj)] = obj
                self._on_change()
        finally:
            self._stream = None
            stream.close()
        return version


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name", ""))
