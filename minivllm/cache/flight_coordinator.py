"""Single-flight: one request computes a prompt, identical ones wait for its pages.

Requests whose input token ids are identical form a *flight*. The first is the leader
and runs normally; the others are followers and are not admitted until the flight is
released. The flight coordinates the prompt's computation only: once released, every
follower looks its prompt up in the prefix cache, restores the leader's pages, and
samples its own output with its own settings.

Release policies:
  at_completion  the flight ends when the leader ends (its pages are published then);
  after_prefill  the engine publishes the leader's prompt pages as soon as its prefill
                 ends and reports it here; the flight ends at once, so followers start
                 while the leader is still decoding.

If the leader is cancelled or fails before the flight ends, the oldest follower is
promoted to lead it: followers never wait on a request that will not publish.

A flight is deleted the moment it is released. Released requests keep running, and
their eventual termination must still be recognised (an unknown id is a bug that should
not be swallowed), so their ids move to one flat `released` set instead of keeping a
"draining" flight alive: nothing about their former flight affects execution any more.
A new identical request after a release starts a new flight (and usually finds the
prompt's pages warm in the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RELEASE_POLICIES = ("at_completion", "after_prefill")


class UnknownFlightRequestError(RuntimeError):
    """A termination was reported for a request the coordinator never saw (an engine bug)."""


@dataclass
class Flight:
    input_ids: tuple[int, ...]
    leader: str
    followers: list[str] = field(default_factory=list)  # arrival order


class FlightCoordinator:
    def __init__(self, release: str):
        if release not in RELEASE_POLICIES:
            raise ValueError(f"release policy {release!r}: allowed {RELEASE_POLICIES}")
        self.release = release
        self.flights: dict[tuple[int, ...], Flight] = {}
        self.flight_of: dict[str, Flight] = {}  # leader and follower ids of open flights
        self.released: set[str] = set()  # ids let go by a closed flight, until they end
        self.counters = {"flights": 0, "followers": 0, "promotions": 0, "released_followers": 0}

    # -- membership -----------------------------------------------------------------------

    def join(self, request_id: str, input_ids: list[int]) -> str | None:
        """Register a new request; return the leader's id if it must wait, else None."""
        if request_id in self.flight_of or request_id in self.released:
            raise ValueError(f"request {request_id!r} joined single-flight twice")
        key = tuple(input_ids)
        flight = self.flights.get(key)
        if flight is None:
            flight = self.flights[key] = Flight(key, request_id)
            self.flight_of[request_id] = flight
            self.counters["flights"] += 1
            return None
        flight.followers.append(request_id)
        self.flight_of[request_id] = flight
        self.counters["followers"] += 1
        return flight.leader

    def waiting_on(self, request_id: str) -> str | None:
        """The leader a follower waits for; None for leaders and released requests."""
        flight = self.flight_of.get(request_id)
        return flight.leader if flight is not None and flight.leader != request_id else None

    def role(self, request_id: str) -> str | None:
        flight = self.flight_of.get(request_id)
        if flight is not None:
            return "leader" if flight.leader == request_id else "follower"
        return "released" if request_id in self.released else None

    # -- events from the engine ---------------------------------------------------------------

    def prefill_done(self, request_id: str) -> list[str]:
        """The request's prompt pages are published. Under after_prefill, a leader's
        flight ends now; returns the followers released."""
        flight = self.flight_of.get(request_id)
        if self.release != "after_prefill" or flight is None or flight.leader != request_id:
            return []
        return self._close(flight)

    def terminated(self, request_id: str, *, prompt_ready: bool) -> list[str]:
        """The request ended (finished, aborted or failed); `prompt_ready` says whether
        its whole prompt was computed and its pages published. Returns the followers
        released, or the promoted follower."""
        if request_id in self.released:
            self.released.discard(request_id)
            return []
        flight = self.flight_of.get(request_id)
        if flight is None:
            raise UnknownFlightRequestError(f"single-flight: termination of unknown request {request_id!r}")
        if flight.leader != request_id:  # a follower cancelled while it waited
            flight.followers.remove(request_id)
            del self.flight_of[request_id]
            return []
        if prompt_ready or not flight.followers:
            released = self._close(flight)
            self.released.discard(request_id)
            return released
        # The leader will never publish this prompt: the oldest follower takes over.
        del self.flight_of[request_id]
        flight.leader = flight.followers.pop(0)
        self.counters["promotions"] += 1
        return [flight.leader]

    def _close(self, flight: Flight) -> list[str]:
        del self.flights[flight.input_ids]
        members = [flight.leader, *flight.followers]
        for rid in members:
            del self.flight_of[rid]
        self.released.update(members)
        self.counters["released_followers"] += len(flight.followers)
        return list(flight.followers)

    # -- inspection -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "release": self.release,
            "flights": [{"leader": f.leader, "followers": list(f.followers), "input_tokens": len(f.input_ids)}
                        for f in self.flights.values()],
            "released": sorted(self.released),
            "counters": dict(self.counters),
        }
