"""The `rpc` backend's connections to its expert ranks, and their failover.

Each rank's connection is checked by its handshake: the share of the placement it holds,
and its quantization. A rank is lost when its connection is dropped, refused or timed out,
or when it answers with what is no answer. A lost rank is routed around while the placement
has a replica of each of its experts elsewhere. A thread of its own probes it until it
answers its handshake and an empty layer call again; the call is needed because a rank
whose computation is stuck still answers handshakes. The layer calls themselves
(`ep_dispatch.rpc`) run on the engine's step thread, on these connections; only probes and
readiness reconnections run beside it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from common.auth import NO_SECRET, ClusterSecret
from common.messages import (
    ExpertBatch,
    ExpertInfo,
    ExpertResult,
    InfoRequest,
    PlacementReady,
    PlacementUpdate,
    Tensor,
    UsePlacement,
)
from common.rpc import LINK_TIMEOUT_S, SocketFrames
from ep_dispatch.placement import Placement

log = logging.getLogger("switchyard.rpc_experts")
PROBE_EVERY_S = 1.0  # how often a lost rank that is routed around is tried again
PREPARE_TIMEOUT_S = 600.0  # for every expert rank to load a rebalanced placement's share


class ExpertRankError(RuntimeError):
    """An expert rank that cannot be reached or answered wrongly; the message names the
    rank. `lost` holds the ranks whose connection is gone; their calls may go to
    replicas."""

    def __init__(self, message: str, lost: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.lost = lost


class ExpertPool:
    def __init__(self, placement: Placement, addresses: list[tuple[str, int]],
                 call_timeout: float = 30.0, connect_timeout: float = 30.0,
                 quantization: str | None = None, secret: ClusterSecret = NO_SECRET,
                 link_timeout: float = LINK_TIMEOUT_S) -> None:
        if len(addresses) != placement.num_ranks:
            raise ValueError(f"{len(addresses)} expert addresses for a placement of "
                             f"{placement.num_ranks} ranks")
        self.placement = placement
        self.version = 0  # of the placement, as the expert ranks know it (`switch`)
        self._prepared: dict[int, tuple[Placement, list[PlacementReady]]] = {}
        self.addresses = addresses
        self.call_timeout = call_timeout
        self.quantization = quantization
        self.secret = secret
        self.link_timeout = link_timeout  # a rank silent this long is lost
        self.conns: list[SocketFrames | None] = [None] * len(addresses)
        # Lost ranks, routed around while replicas allow, and those being probed. The step
        # thread and the probes' threads share them under `_lock`, never held across a call.
        self.lost: set[int] = set()
        self._probing: set[int] = set()
        self._reconnecting = False  # a reconnection for readiness is running
        self._lock = threading.Lock()
        self._closing = threading.Event()  # once set, no probe starts, and those running end
        self._threads: list[threading.Thread] = []
        self._probe_conns: set[SocketFrames] = set()  # a probe's, until it ends (`close`)
        self._routes: dict[frozenset[int], Placement] = {}  # keyed by the lost ranks
        self.empty_call: Tensor | None = None  # [0, width] rows on the wire, for probes
        self.infos: list[ExpertInfo] = []
        deadline = time.monotonic() + connect_timeout
        try:
            for rank in range(len(addresses)):  # the lowest unreachable rank is named
                self.conns[rank], info = self._handshake(rank, deadline, retry=True)
                self.infos.append(info)
        except BaseException:
            self.close()
            raise

    def name(self, rank: int) -> str:
        host, port = self.addresses[rank]
        return f"expert rank {rank} at {host}:{port}"

    def _handshake(self, rank: int, deadline: float, retry: bool, load: bool = False
                   ) -> tuple[SocketFrames, ExpertInfo]:
        """A connection to `rank` that holds the placement's share; a connection that does
        not is closed. With `retry`, it tries until the rank listens. With `load`, used off
        the step thread, a rank that does not hold the placement version routed by loads it
        first. That happens when the rank restarted since a rebalance."""
        try:
            conn = SocketFrames.connect(*self.addresses[rank], deadline, retry,
                                        self.secret, self.link_timeout)
        except (OSError, TimeoutError) as exc:
            raise ExpertRankError(f"cannot reach {self.name(rank)} within "
                                  f"{self.call_timeout:g}s: {exc!r}") from None
        try:
            conn.send(InfoRequest(), deadline)
            info = conn.receive(deadline)
        except BaseException:
            conn.close()
            raise
        with self._lock:  # a switch may run on the step thread while a probe connects
            version, placement = self.version, self.placement
        want = placement.local_experts(rank)
        if load and version and isinstance(info, ExpertInfo) and version not in info.shares:
            try:
                info = self._load_share(conn, rank, version, placement)
            except BaseException:
                conn.close()
                raise
        problem = None
        if not isinstance(info, ExpertInfo) or info.rank != rank or \
                (info.shares.get(version) if info.shares else info.experts) != want:
            problem = (f"holds a different share than placement version {version} "
                       f"expects: {info}")
        elif info.quantization != self.quantization:
            problem = (f"serves quantization {info.quantization}, this attention service "
                       f"{self.quantization}: start both with the same --quantization")
        if problem:
            conn.close()
            raise ExpertRankError(f"{self.name(rank)} {problem}")
        try:
            conn.send(UsePlacement(version), deadline)
        except BaseException:
            conn.close()
            raise
        return conn, info

    def _load_share(self, conn: SocketFrames, rank: int, version: int, placement: Placement
                    ) -> ExpertInfo:
        """Have `rank` load its share of `placement` as `version` on `conn`. Returns its
        info."""
        log.warning("%s does not hold placement version %d (restarted?): loading it",
                    self.name(rank), version)
        deadline = time.monotonic() + PREPARE_TIMEOUT_S
        conn.send(PlacementUpdate(version, placement.to_json()), deadline)
        ready = conn.receive(deadline)
        if not isinstance(ready, PlacementReady) or ready.error is not None:
            raise ExpertRankError(f"{self.name(rank)} could not load placement version "
                                  f"{version}: {getattr(ready, 'error', ready)}")
        conn.send(InfoRequest(), deadline)
        return conn.receive(deadline)

    def prepare(self, version: int, placement: Placement) -> list[PlacementReady]:
        """Have every expert rank load its share of `placement` as `version`, on
        connections of this call's own.

        This blocks, and runs off the step thread. The ranks load at once, each while it
        serves. Raises `ExpertRankError` naming a rank that is lost, cannot be reached, or
        could not load it; the old placement then serves on.
        """
        if placement.num_ranks != len(self.addresses):
            raise ExpertRankError(f"placement version {version} places experts on "
                                  f"{placement.num_ranks} ranks; there are "
                                  f"{len(self.addresses)}")
        if lost := sorted(self.lost):
            raise ExpertRankError(f"{self.name(lost[0])} is lost: it cannot load placement "
                                  f"version {version}", frozenset(lost))
        deadline = time.monotonic() + PREPARE_TIMEOUT_S
        conns: list[SocketFrames] = []
        try:
            update = PlacementUpdate(version, placement.to_json())
            for rank in range(len(self.addresses)):
                try:
                    conns.append(SocketFrames.connect(*self.addresses[rank], deadline, False,
                                                      self.secret, self.link_timeout))
                    conns[-1].send(update, deadline)
                except (OSError, TimeoutError) as exc:
                    raise ExpertRankError(f"cannot reach {self.name(rank)} to load "
                                          f"placement version {version}: {exc!r}") from exc
            readies = []
            for rank, conn in enumerate(conns):
                ready = conn.receive(deadline)
                if not isinstance(ready, PlacementReady) or ready.version != version:
                    raise ExpertRankError(f"{self.name(rank)} answered out of turn")
                if ready.error is not None or ready.experts != placement.local_experts(rank):
                    raise ExpertRankError(f"{self.name(rank)} could not load placement "
                                          f"version {version}: {ready.error}")
                readies.append(ready)
        finally:
            for conn in conns:
                conn.close()
        self._prepared[version] = (placement, readies)
        return readies

    def switch(self, version: int) -> None:
        """Lay the calls out by the prepared placement `version` from now on, and tell each
        connected rank so. This runs on the step thread between steps, when no call is in
        flight."""
        if version not in self._prepared:
            raise ValueError(f"placement version {version} was not prepared")
        placement, readies = self._prepared.pop(version)
        with self._lock:
            if self.lost and placement.excluding(frozenset(self.lost)) is None:
                raise ExpertRankError(f"placement version {version} puts an expert only on "
                                      f"lost ranks {sorted(self.lost)}", frozenset(self.lost))
            self.placement, self.version, self._routes = placement, version, {}
            self._prepared = {v: p for v, p in self._prepared.items() if v > version}
        self.infos = [ExpertInfo(i.rank, i.num_ranks, r.experts, r.weight_bytes, i.quantization)
                      for i, r in zip(self.infos, readies, strict=True)]
        deadline = time.monotonic() + self.call_timeout
        for rank, conn in enumerate(self.conns):
            if conn is not None:
                try:
                    conn.send(UsePlacement(version), deadline)
                except (OSError, TimeoutError):
                    self.drop(rank)  # connected again, with this version, at its next call

    def conn(self, rank: int) -> SocketFrames:
        """`rank`'s connection. If it was dropped, it is connected again, once and without
        retrying, so a refused connection is a lost rank now, not after a call timeout."""
        conn = self.conns[rank]
        if conn is None:
            try:
                conn, _ = self._handshake(rank, time.monotonic() + self.call_timeout,
                                          retry=False)
            except Exception as exc:  # refused, dropped, timed out, garbage: lost
                raise ExpertRankError(f"{self.name(rank)} is not connected: {exc!r}",
                                      frozenset({rank})) from exc
            with self._lock:  # a readiness reconnection may have connected it meanwhile
                if self.conns[rank] is None:
                    self.conns[rank], conn = conn, None
                kept = self.conns[rank]
            if conn is not None:
                conn.close()
            assert kept is not None
            return kept
        return conn

    def drop(self, rank: int) -> None:
        """Close `rank`'s connection: it may hold a late answer, so it is never used again."""
        conn, self.conns[rank] = self.conns[rank], None
        if conn is not None:
            conn.close()

    def routing(self) -> Placement:
        """The placement without the lost ranks, each of which is being probed."""
        with self._lock:
            if not self.lost:
                return self.placement
            new = set() if self._closing.is_set() else self.lost - self._probing
            self._probing |= new
            lost = frozenset(self.lost)
        for rank in new:
            self._start(f"_probe expert rank {rank}", self._probe, rank)
        if lost not in self._routes:  # a placement builds its lookup tables once
            routing = self.placement.excluding(lost)
            assert routing is not None  # `route_around` adds ranks only while this holds
            self._routes[lost] = routing
        return self._routes[lost]

    def route_around(self, exc: ExpertRankError) -> bool:
        """Whether the ranks `exc` lost can be routed around; if so, they are. Each retry
        of a layer call loses one rank more, or is not made."""
        with self._lock:
            lost = self.lost | exc.lost
            if lost == self.lost or self.placement.excluding(frozenset(lost)) is None:
                return False
            for rank in sorted(exc.lost - self.lost):
                log.warning("%s is lost (%s): its experts go to their replicas until it "
                            "answers again", self.name(rank), exc)
            self.lost = lost
        return True

    def wait_back(self, ranks: frozenset[int], deadline: float) -> bool:
        """Hold the calling step until each of `ranks` is connected again. Returns whether
        all were, by `deadline`.

        The ranks are lost ones with experts no replica holds. One comes back when its
        service restarts in time; it then loads the placement routed by if it has another
        (`_handshake`).
        """
        for rank in sorted(ranks):
            if self.conns[rank] is not None:  # back already, for another exchange
                continue
            if time.monotonic() >= deadline or self._closing.is_set():
                return False
            try:  # retrying until it listens again, within the deadline
                conn, _ = self._handshake(rank, deadline, retry=True, load=True)
            except Exception as exc:  # not back in time, or back wrong: the call fails
                log.warning("%s did not come back within the wait: %s", self.name(rank), exc)
                return False
            with self._lock:  # a readiness reconnection may have connected it meanwhile
                if self.conns[rank] is None:
                    self.conns[rank], conn = conn, None
            if conn is not None:
                conn.close()
            log.warning("%s is back: the held layer call is sent again", self.name(rank))
        return True

    def _start(self, name: str, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _probe(self, rank: int) -> None:
        """Try a lost rank, with its handshake and then an empty layer call, until it
        answers; then it is back in the routing. Tries come at most every `PROBE_EVERY_S`,
        whatever a try raises. Ends early on `close`."""
        reason = ""
        try:
            while not self._closing.is_set():
                started = time.monotonic()
                try:
                    conn = self._answers_a_call(rank)  # this may load a rebalanced share
                    with self._lock:
                        self.conns[rank] = conn
                        self.lost.discard(rank)
                    log.warning("%s answers again: back in the routing", self.name(rank))
                    return
                except Exception as exc:  # e.g. a share that differs: said once, tried again
                    if str(exc) != reason:
                        reason = str(exc)
                        log.warning("%s is still lost: %s", self.name(rank),
                                    reason or repr(exc))
                self._closing.wait(max(0.0, started + PROBE_EVERY_S - time.monotonic()))
        finally:
            with self._lock:
                self._probing.discard(rank)

    def _answers_a_call(self, rank: int) -> SocketFrames:
        """A new connection to `rank` that answered an empty layer call within the call
        timeout. The call waits behind whatever that rank computes, as a real call would."""
        deadline = time.monotonic() + self.call_timeout
        conn, _ = self._handshake(rank, deadline, retry=False, load=True)  # probes retry
        with self._lock:
            version, experts = self.version, self.placement.local_experts(rank)
        if self.empty_call is None or not experts:
            return conn  # no call was made yet: nothing to be stuck behind
        layer = min(experts)
        with self._lock:
            self._probe_conns.add(conn)
        try:
            conn.send(ExpertBatch(-1, layer, [0] * len(experts[layer]), self.empty_call,
                                  version=version), deadline)
            result = conn.receive(deadline)
            if not isinstance(result, ExpertResult) or result.call_id != -1:
                raise ExpertRankError(f"{self.name(rank)} answered out of turn")
        except BaseException:
            conn.close()
            raise
        finally:
            with self._lock:
                self._probe_conns.discard(conn)
        return conn

    def ready(self) -> bool:
        """Whether every layer call can be served: every rank is connected, or lost and
        routed around. A rank dropped otherwise is connected again at its next call, and
        in the background from here. So a health check that keeps asking sees it back, even
        while no traffic comes because it answered "not ready"."""
        with self._lock:
            missing = [rank for rank, conn in enumerate(self.conns)
                       if conn is None and rank not in self.lost]
            start = bool(missing) and not self._reconnecting and not self._closing.is_set()
            self._reconnecting |= start
        if start:
            self._start("_reconnect expert ranks", self._reconnect)
        return not missing

    def _reconnect(self) -> None:
        try:
            for rank, conn in enumerate(self.conns):
                if conn is not None or rank in self.lost:
                    continue
                try:  # still down: the next check tries again
                    new, _info = self._handshake(rank, time.monotonic() + self.call_timeout,
                                                 retry=False, load=True)
                except Exception:
                    continue
                with self._lock:  # a layer call may have connected it meanwhile
                    if self.conns[rank] is None and not self._closing.is_set():
                        self.conns[rank] = new
                        new = None
                if new is not None:
                    new.close()
        finally:
            with self._lock:
                self._reconnecting = False

    def describe(self) -> list[str]:
        return [f"{self.name(i.rank)}: {sum(map(len, i.experts.values()))} experts over "
                f"{len(i.experts)} MoE layers, {i.weight_bytes / 1e6:.1f} MB"
                f"{' MXFP4' if i.quantization else ''}, "
                f"{'connected' if self.conns[i.rank] else 'disconnected'}"
                f"{' (lost: routed to replicas)' if i.rank in self.lost else ''}"
                for i in self.infos]

    def close(self) -> None:
        """Stop the probes, each closing its half-open connection as it ends, then close
        every connection."""
        self._closing.set()
        with self._lock:
            for conn in self._probe_conns:  # a probe waiting on a stuck rank ends now
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(self.call_timeout + 5)
        with self._lock:
            for rank in range(len(self.conns)):
                self.drop(rank)
