"""The responses a server keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``:
in memory, the oldest dropped first beyond a count and a byte budget (a client controls
how much each holds, so both are bounded)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as answered
    conversation: list[dict]  # chat messages up to and including its output, without instructions
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 256 << 20):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # read from the preprocessor's threads, written on the event loop

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes or self.max_entries == 0:
            return
        with self._lock:
            self._entries[response["id"]] = StoredResponse(response, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            dropped = self._entries.pop(response_id, None)
            if dropped is not None:
                self._bytes -= dropped.size
            return dropped is not None
