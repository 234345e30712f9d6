"""The notice board of a watched group: keys in the group's store that ranks write once and
read while they wait. Notices say why a peer left (a failure, a closed layer); votes carry each
rank's verdict on one decision (a placement change), so the survivors of a death in the middle
of it all read the same votes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch.distributed as dist

DISPATCHER_NOTICE = "dispatcher"


@dataclass(frozen=True)
class InFlight:
    """The forward a wait belongs to: its layer's index and its number on that layer (from 1,
    the same on every rank)."""

    layer: int
    forward: int


@dataclass(frozen=True)
class NoticeBoard:
    """A watched comm's namespace in its group's store, and the peers on this host."""

    namespace: str
    store: dist.Store | None  # None: torch did not say which store the group uses
    local_peers: tuple[tuple[int, int], ...]  # (rank, pid)

    def key(self, rank: int, topic: str) -> str:
        return f"{self.namespace}/{rank}/{topic}"

    def post(self, rank: int, topic: str, text: str, about: int | None, after_forward: int) -> None:
        """Best effort: a notice must never raise on the failure path."""
        if self.store is None:
            return
        try:
            fields = {
                "text": text,
                "time": time.time(),
                "rank": rank if about is None else about,
                "after": after_forward,
            }
            self.store.set(self.key(rank, topic), json.dumps(fields))
            self.store.add(f"{self.namespace}/count", 1)
        except Exception:
            return

    def count(self) -> int:
        """Notices posted so far (a cheap test for news)."""
        assert self.store is not None
        return int(self.store.add(f"{self.namespace}/count", 0))

    def read(self, me: int, world_size: int, in_flight: InFlight | None) -> list[tuple[int, str]]:
        """(rank, text) of the other ranks' notices that concern ``in_flight``, earliest first:
        every dispatcher notice; a layer's notice only for its forwards after ``after``."""
        assert self.store is not None
        topics = [DISPATCHER_NOTICE]
        forward = 0
        if in_flight is not None:
            topics.append(f"layer{in_flight.layer}")
            forward = in_flight.forward
        found = []
        for rank in range(world_size):
            if rank == me:
                continue
            for topic in topics:
                key = self.key(rank, topic)
                if self.store.check([key]):
                    notice = json.loads(self.store.get(key))
                    if topic == DISPATCHER_NOTICE or forward > notice["after"]:
                        found.append((notice["time"], notice["rank"], notice["text"]))
        return [(rank, text) for _, rank, text in sorted(found)]

    # ----------------------------------------------------------------- votes
    def _vote_key(self, ballot: str, rank: int) -> str:
        return f"{self.namespace}/vote/{ballot}/{rank}"

    def cast_vote(self, ballot: str, rank: int, verdict: str | None) -> None:
        assert self.store is not None
        self.store.set(self._vote_key(ballot, rank), json.dumps(verdict))

    def has_voted(self, ballot: str, rank: int) -> bool:
        assert self.store is not None
        return self.store.check([self._vote_key(ballot, rank)])

    def votes(self, ballot: str, world_size: int) -> list[str | None] | None:
        """Every rank's verdict, or None while a vote is missing."""
        assert self.store is not None
        keys = [self._vote_key(ballot, rank) for rank in range(world_size)]
        if not self.store.check(keys):
            return None
        return [json.loads(self.store.get(key)) for key in keys]

    def votes_so_far(
        self, ballot: str, world_size: int, missing: int, reason: str
    ) -> list[str | None]:
        """The verdicts cast, with ``missing`` (gone before voting) failing for ``reason``; a
        rank still to vote counts as going ahead (only the missing one decides)."""
        votes: list[str | None] = [
            json.loads(self.store.get(self._vote_key(ballot, rank)))  # type: ignore[union-attr]
            if self.has_voted(ballot, rank)
            else None
            for rank in range(world_size)
        ]
        votes[missing] = f"{reason} (before its vote on {ballot})"
        return votes
