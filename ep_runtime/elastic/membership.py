"""Who survived: the members of a re-formed group, agreed through a store no rank process holds.

Every survivor of generation ``g`` joins generation ``g + 1`` by writing its key. The member
list is closed once, by whichever survivor first sees that every rank of generation ``g`` has
either joined or is known to be gone (its process on this host has ended), or that the join
window has passed since the first join: it writes the list with the store's compare-and-set,
so the first list written is the only one, and every survivor reads that same list. A rank
that joins after the list was closed (slow but alive) is out on every rank, and is told so: it
raises instead of computing beside a group that does not count it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from ep_runtime.types import GroupUnusableError

POLL_S = 0.02
DEFAULT_JOIN_WINDOW_S = 3.0


class CountedOutError(GroupUnusableError):
    """This rank joined a re-formed group after its members were agreed: it is not one of them."""


@dataclass(frozen=True)
class Membership:
    """The agreed members of one generation: original ranks, ascending (the new rank of each is
    its index), and the ranks of the previous generation left out."""

    generation: int
    members: tuple[int, ...]
    left_out: tuple[int, ...]

    def new_rank(self, original_rank: int) -> int:
        return self.members.index(original_rank)


def _key(generation: int, what: str) -> str:
    return f"elastic/gen{generation}/{what}"


def agree_members(
    store: dist.Store,
    generation: int,
    me: int,
    previous: Sequence[int],
    is_gone: Callable[[int], bool],
    join_window_s: float = DEFAULT_JOIN_WINDOW_S,
    timeout_s: float = 60.0,
) -> Membership:
    """Join ``generation`` as original rank ``me`` (one of ``previous``, the members of the
    generation before) and return the agreed ``Membership``.

    Parameters
    ----------
    store : torch.distributed.Store
        The run's rendezvous store (hosted by the launcher, never by a rank).
    generation : int
        The generation being formed (the first group is 0).
    me : int
        This process's original rank.
    previous : sequence of int
        The previous generation's members (original ranks).
    is_gone : callable
        ``is_gone(original_rank)``: True when that rank is known to have ended.
    join_window_s : float
        How long after the first join the list closes without the ranks not known gone.
    timeout_s : float
        How long to wait for the list at all.

    Raises
    ------
    CountedOutError
        The list was closed without this rank.
    """
    members_key = _key(generation, "members")
    store.set(_key(generation, f"joined/{me}"), str(time.time()))
    first = float(store.compare_set(_key(generation, "first_join"), "", str(time.time())))
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([members_key]):
            break
        joined = [r for r in previous if store.check([_key(generation, f"joined/{r}")])]
        settled = all(r in joined or is_gone(r) for r in previous)
        if settled or time.time() - first >= join_window_s:
            proposal = json.dumps(sorted(joined))
            store.compare_set(members_key, "", proposal)
            break
        if time.monotonic() > deadline:
            raise GroupUnusableError(
                f"generation {generation}: no member list within {timeout_s:.0f} s"
            )
        time.sleep(POLL_S)
    members = tuple(json.loads(store.get(members_key).decode()))
    if me not in members:
        raise CountedOutError(
            f"this rank (original rank {me}) joined generation {generation} after its members "
            f"were agreed ({list(members)}): it is out of the group"
        )
    left_out = tuple(r for r in previous if r not in members)
    return Membership(generation, members, left_out)
