"""In-process caches of immutable things.

- :class:`BundleCache`: bundle bytes by sha256. A bundle's content is fixed by its hash, so a
  cached copy can never be stale; the bytes were verified (re-hashed) when read from the
  database (:func:`service.store.kernel_cache.get_bundle_bytes`). Bounded by total size (LRU).
- :class:`SpecCache`: per spec_hash, the canonical spec and the dim names of the spec as first
  stored (specs are immutable by hash), so kernel lookups need not parse a spec each time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class BundleCache:
    def __init__(self, max_bytes: int = 256 * 1024 * 1024):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, sha256: str) -> bytes | None:
        with self._lock:
            content = self._items.get(sha256)
            if content is not None:
                self._items.move_to_end(sha256)
            return content

    def put(self, sha256: str, content: bytes) -> None:
        if len(content) > self.max_bytes // 4:
            return  # one huge bundle must not evict everything else
        with self._lock:
            if sha256 in self._items:
                return
            self._items[sha256] = content
            self._size += len(content)
            while self._size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)


class SpecCache:
    def __init__(self, max_items: int = 1024):
        self.max_items = max_items
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
