"""Record, replay, inspect and re-verify rosbag2 bags of wisv_ros topics.

    python -m wisv_ros.cli.bag record OUT [--namespace NS ...] [--topics T ...] [--duration S]
    python -m wisv_ros.cli.bag replay BAG [--topics T ...] [--remap OLD:=NEW ...] [--rate R] [--loop]
    python -m wisv_ros.cli.bag info BAG
    python -m wisv_ros.cli.bag reverify BAG --target MODEL [--target-dtype D] [--head PATH] [--csv F]

Bags are rosbag2 folders (metadata version 9, mcap storage; ``wisv_ros.interfaces.bags``) that a robot's
``ros2 bag info`` / ``ros2 bag play`` read. ``info`` and ``reverify`` need no ROS; ``record`` and
``replay`` are rclpy nodes (one SingleThreadedExecutor; callbacks never block).

QoS (rosbag2's own rules, stated here because they decide what a bag holds):

- record subscribes to each topic with keep-last ``RECORD_DEPTH`` (1000, so a busy recorder does
  not drop messages); *reliable* if every publisher offers reliable, else best-effort (a reliable
  subscription would not match a best-effort publisher, e.g. the link monitor's probes);
  *transient-local* if every publisher offers it, else volatile. So ``channel_state`` from the
  link monitor (``link_monitor_node.STATE_QOS``: reliable, transient-local, keep-last 1) is
  recorded transient-local and the latest estimate published before the recording started is
  recorded too (stamped with its reception time); the nodes' topics (``common.RELIABLE_QOS``:
  reliable, volatile, keep-last 10) are recorded reliable and volatile. The publishers' offered
  QoS go into the bag's metadata. A publisher that appears later with an incompatible QoS is not
  recorded (its messages never arrive; rosbag2 behaves the same way).
- replay publishes each topic with the recorded offered QoS: reliable unless a recorded publisher
  was best-effort, transient-local only if every recorded publisher was (so a replayed
  ``channel_state`` reaches a consumer that starts late, as the link monitor's does), keep-last
  with the recorded depth (at least 10; DDS discovery does not report the publisher's depth).
  A topic without recorded QoS gets ``common.RELIABLE_QOS``.

Replay keeps the recorded spacing (reception times) divided by ``--rate``; it reports how late each
publish was against that schedule. ``reverify`` re-runs the target's verification of every
recorded draft block with the core ``Verifier`` and compares with the recorded verdicts.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import os
import signal
import statistics
import sys
import threading
import time
from bisect import bisect_right
from pathlib import Path

from wisv_ros.interfaces.bags import BagError, BagWriter, QosSpec, open_bag, type_hash
from wisv_ros.sd.engines import BACKENDS
from wisv_ros.sd.models import WEIGHT_DTYPES, resolve_dtype

RECORD_DEPTH = 1000  # keep-last depth of the recorder's subscriptions
REPLAY_MIN_DEPTH = 10  # keep-last depth of replay publishers when the bag records none (or 0)
MSG_PREFIX = "wisv_ros/msg/"


def _fail(text: str) -> None:
    print(f"error: {text}", file=sys.stderr)
    sys.exit(2)


def _norm_topic(name: str) -> str:
    name = name.strip()
    if not name:
        raise BagError("topic: empty name")
    return name if name.startswith("/") else "/" + name


def _namespace(topic: str) -> str:
    ns = topic.rsplit("/", 1)[0]
    return ns or "/"


def _stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGINT (Ctrl-C) or SIGTERM. Installed after rclpy.init, replacing rclpy's
    handlers, so a signal never interrupts a bag write half-way nor invalidates the context while
    the executor waits; the loops check the event and close the bag themselves."""
    stop = threading.Event() if stop is None else stop
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _msg_class(msgtype: str):
    """The generated Python class of ``pkg/msg/Name``; BagError saying what to source if missing."""
    try:
        pkg, kind, name = msgtype.split("/")
        return getattr(importlib.import_module(f"{pkg}.{kind}"), name)
    except (ValueError, ImportError, AttributeError) as exc:
        raise BagError(f"type {msgtype}: cannot import its Python class ({exc}); source the workspace that "
                       "built the interfaces (tools/env.sh here)") from None


# =========================================================================== record
def _record(args) -> int:
    out = Path(args.out)
    namespaces = [_norm_topic(ns).rstrip("/") or "/" for ns in args.namespace or []]
    topics = {_norm_topic(t) for t in args.topics or []}
    if args.duration is not None and args.duration <= 0:
        raise BagError(f"--duration: must be > 0 s, got {args.duration}")
    writer = BagWriter(out)  # BagError if OUT exists
    store = writer.store

    from rclpy.node import Node
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

    from wisv_ros.nodes.common import run_node

    def wanted(topic: str) -> bool:
        if not namespaces and not topics:
            return True
        return topic in topics or any(ns == "/" or topic.startswith(ns + "/") for ns in namespaces)

    def offered(info) -> QosSpec:
        q = info.qos_profile
        hist = {HistoryPolicy.KEEP_LAST: "keep_last", HistoryPolicy.KEEP_ALL: "keep_all"}.get(q.history, "unknown")
        rel = {ReliabilityPolicy.RELIABLE: "reliable", ReliabilityPolicy.BEST_EFFORT: "best_effort"}.get(q.reliability, "unknown")
        dur = {DurabilityPolicy.VOLATILE: "volatile", DurabilityPolicy.TRANSIENT_LOCAL: "transient_local"}.get(q.durability, "unknown")
        return QosSpec(hist, int(q.depth), rel, dur)

    class Recorder(Node):
        def __init__(self):
            super().__init__(f"wisv_bag_record_{os.getpid()}")
            self.t_start = time.monotonic()
            self.warned: set[str] = set()
            self.subs: dict[str, object] = {}
            self.create_timer(args.poll, self.discover)
            self.create_timer(args.progress, self.progress)
            self.discover()

        def warn(self, key: str, text: str) -> None:
            if key not in self.warned:
                self.warned.add(key)
                print(f"\n[record] warning: {text}", file=sys.stderr, flush=True)

        def discover(self) -> None:
            for name, types in self.get_topic_names_and_types():
                if name in self.subs or not wanted(name):
                    continue
                ours = [t for t in types if t.startswith(MSG_PREFIX)]
                if not ours:
                    if name in topics:
                        self.warn(name, f"topic {name} has type {', '.join(types)}, not a wisv_ros message; not recorded")
                    continue
                msgtype = ours[0]
                if len(types) > 1:
                    self.warn(name, f"topic {name} has several types {types}; recording {msgtype}")
                if msgtype not in store.fielddefs:
                    self.warn(name, f"topic {name}: type {msgtype} is not in this package's msg/ files; not recorded "
                                    "(rebuild the interfaces)")
                    continue
                infos = [i for i in self.get_publishers_info_by_topic(name) if i.topic_type == msgtype]
                if not infos:
                    continue  # subscribers only so far: the QoS is chosen when a publisher appears
                ours_hash = type_hash(msgtype, store)
                theirs = {str(getattr(i, "topic_type_hash", "")) for i in infos} - {""}
                theirs = {h for h in theirs if h.startswith("RIHS01_")}  # Humble carries no hashes
                if theirs and theirs != {ours_hash}:
                    self.warn(name, f"topic {name}: publishers' type hash {sorted(theirs)} differs from this package's "
                                    f"{msgtype} ({ours_hash}); the robot runs other message definitions; not recorded")
                    continue
                specs = [offered(i) for i in infos]
                reliable = all(s.reliability == "reliable" for s in specs)
                latched = all(s.durability == "transient_local" for s in specs)
                qos = QoSProfile(
                    history=HistoryPolicy.KEEP_LAST, depth=RECORD_DEPTH,
                    reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                    durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE,
                )
                writer.add_topic(name, msgtype, specs)
                self.subs[name] = self.create_subscription(
                    _msg_class(msgtype), name, lambda data, topic=name: self.on_msg(topic, data), qos, raw=True)
                print(f"\n[record] recording {name} ({msgtype}; {'reliable' if reliable else 'best_effort'}, "
                      f"{'transient_local' if latched else 'volatile'})", file=sys.stderr, flush=True)

        def on_msg(self, topic: str, data: bytes) -> None:
            writer.write(topic, self.get_clock().now().nanoseconds, data)

        def progress(self) -> None:
            counts = "  ".join(f"{t} {n}" for t, n in sorted(writer.counts.items())) or "(no topics yet)"
            end = "\r" if sys.stderr.isatty() else "\n"
            print(f"[record] {time.monotonic() - self.t_start:6.1f} s  {counts}", end=end, file=sys.stderr, flush=True)

    writer.open()
    stop = threading.Event()
    deadline = None if args.duration is None else time.monotonic() + args.duration

    def recorder() -> Recorder:  # called by run_node after rclpy.init: our signal handlers replace rclpy's
        _stop_on_signals(stop)
        return Recorder()

    try:
        run_node(recorder, args=args.rclpy_args,
                 until=lambda: stop.is_set() or (deadline is not None and time.monotonic() >= deadline),
                 process_exit=False)
    finally:
        writer.close()
    total = sum(writer.counts.values())
    print(f"\n[record] wrote {total} messages on {len(writer.counts)} topics to {out}", file=sys.stderr)
    for t, n in sorted(writer.counts.items()):
        print(f"[record]   {t}: {n}", file=sys.stderr)
    missing = sorted(topics - set(writer.counts))
    if missing:
        print(f"[record] never seen with a publisher: {', '.join(missing)}", file=sys.stderr)
    return 0


# =========================================================================== replay
def parse_remaps(rules: list[str], topics: list[str]) -> dict[str, str]:
    """{recorded topic: replayed topic} from ``OLD:=NEW`` rules.

    A rule applies to the topic named OLD, or to every topic under the namespace OLD
    (``/robot:=/sim`` moves ``/robot/verdict`` to ``/sim/verdict``). A rule that matches no
    topic of the bag is an error (a typo would otherwise replay onto the live topics).
    """
    out = {t: t for t in topics}
    for rule in rules:
        if ":=" not in rule:
            raise BagError(f"--remap {rule!r}: expected OLD:=NEW, e.g. /robot:=/replay")
        old, new = (_norm_topic(s) for s in rule.split(":=", 1))
        old, new = old.rstrip("/") or "/", new.rstrip("/") or "/"
        hits = [t for t in topics if t == old or t.startswith(old + "/") or old == "/"]
        if not hits:
            raise BagError(f"--remap {rule!r}: {old} matches no topic of the bag ({', '.join(topics)})")
        for t in hits:
            rest = t[len(old):] if old != "/" else t
            out[t] = (new if new != "/" else "") + rest if rest else new
    return out


def _replay_qos(specs):
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

    from wisv_ros.nodes.common import RELIABLE_QOS

    if not specs:
        return RELIABLE_QOS
    reliable = all(s.reliability != "best_effort" for s in specs)
    latched = all(s.durability == "transient_local" for s in specs)
    depth = max([REPLAY_MIN_DEPTH] + [s.depth for s in specs if s.history == "keep_last"])
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=depth,
        reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
        durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE,
    )


def _replay(args) -> int:
    if not args.rate > 0:
        raise BagError(f"--rate: must be > 0, got {args.rate}")
    bag = open_bag(args.bag)
    infos = {t.name: t for t in bag.topics()}
    topics = bag.check_topics([_norm_topic(t) for t in args.topics]) if args.topics else sorted(infos)
    remap = parse_remaps(args.remap or [], topics)
    classes = {t: _msg_class(infos[t].msgtype) for t in topics}
    if bag.message_count == 0:
        raise BagError(f"{bag.path}: the bag holds no messages")

    import rclpy
    from rclpy.duration import Duration
    from rclpy.executors import ExternalShutdownException
    from rclpy.qos import ReliabilityPolicy

    rclpy.init(args=args.rclpy_args)
    stop = _stop_on_signals()
    node = rclpy.create_node(f"wisv_bag_replay_{os.getpid()}")
    pubs = {t: node.create_publisher(classes[t], remap[t], _replay_qos(infos[t].offered_qos)) for t in topics}
    for t in topics:
        q = pubs[t].qos_profile
        print(f"[replay] {t} -> {remap[t]} ({infos[t].msgtype}; {q.reliability.name.lower()}, "
              f"{q.durability.name.lower()}, keep_last {q.depth})", file=sys.stderr)
    counts = {t: 0 for t in topics}
    late_ms: list[float] = []
    try:
        if args.wait_for_subscribers > 0:
            deadline = time.monotonic() + args.wait_for_subscribers
            while (any(p.get_subscription_count() == 0 for p in pubs.values()) and time.monotonic() < deadline
                   and not stop.is_set()):
                stop.wait(0.05)
            lonely = [remap[t] for t, p in pubs.items() if p.get_subscription_count() == 0]
            if lonely:
                print(f"[replay] no subscriber after {args.wait_for_subscribers} s on: {', '.join(lonely)}; "
                      "replaying anyway", file=sys.stderr)
        while not stop.is_set():
            first = None
            t0 = time.perf_counter()
            for m in bag.messages(topics):
                if first is None:
                    first = m.t_ns
                due = t0 + (m.t_ns - first) / 1e9 / args.rate
                wait = due - time.perf_counter()
                if wait > 0 and stop.wait(wait):  # Ctrl-C / SIGTERM during the wait
                    break
                pubs[m.topic].publish(m.data)
                late_ms.append((time.perf_counter() - due) * 1e3)
                counts[m.topic] += 1
            if not args.loop:
                break
        for p in pubs.values():  # reliable: let the subscribers acknowledge before the node goes
            if p.qos_profile.reliability == ReliabilityPolicy.RELIABLE:
                p.wait_for_all_acked(Duration(seconds=2.0))
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    n = sum(counts.values())
    print(f"[replay] published {n} messages on {len(topics)} topics", file=sys.stderr)
    for t in topics:
        print(f"[replay]   {remap[t]}: {counts[t]}", file=sys.stderr)
    if late_ms:
        print(f"[replay] timing: publish later than the recorded schedule by median {statistics.median(late_ms):.2f} ms, "
              f"max {max(late_ms):.2f} ms", file=sys.stderr)
    return 0


# =========================================================================== info
def _info(args) -> int:
    from datetime import datetime, timezone

    bag = open_bag(args.bag)
    start = (datetime.fromtimestamp(bag.start_ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds")
             if bag.message_count else "-, no messages")
    print(f"bag:        {bag.path}")
    print(f"storage:    {bag.storage or '?'}, rosbag2 metadata version {bag.version}")
    print(f"duration:   {bag.duration_ns / 1e9:.3f} s (start {start})")
    print(f"messages:   {bag.message_count}")
    rows = [("topic", "type", "count", "qos (offered)")]
    for t in bag.topics():
        qos = "; ".join(sorted({f"{q.reliability}, {q.durability}" for q in t.offered_qos})) or "-"
        rows.append((t.name, t.msgtype, str(t.count), qos))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for line in bag.definition_mismatches():
        print(f"warning: type hash differs: {line}", file=sys.stderr)
    return 0


# =========================================================================== reverify
@dataclasses.dataclass
class RequestReport:
    namespace: str
    request_id: str
    rounds: int = 0  # rounds with a recorded verdict (resends counted once)
    committed: int = 0  # tokens committed by those rounds (recorded)
    compared: int = 0  # verdicts re-computed and compared
    equal: int = 0
    first_diff: str = ""  # round and what differed, of the first differing verdict
    copied: int = 0  # tokens of SwitchSD copy rounds in the verdicts (recorded, not re-verified)
    skipped: dict = dataclasses.field(default_factory=dict)  # reason -> count

    @property
    def aal(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _reverify(args) -> int:
    if args.head and not os.path.isfile(args.head):
        raise BagError(f"--head {args.head}: no such file")
    bag = open_bag(args.bag)
    topics = [t.name for t in bag.topics()]
    namespaces = sorted({_namespace(t) for t in topics if t.endswith("/draft_block")}
                        & {_namespace(t) for t in topics if t.endswith("/verdict")})
    if args.namespace:
        want = [_norm_topic(ns).rstrip("/") or "/" for ns in args.namespace]
        unknown = [ns for ns in want if ns not in namespaces]
        if unknown:
            raise BagError(f"--namespace {', '.join(unknown)}: no draft_block + verdict topics there; "
                           f"namespaces with both: {', '.join(namespaces) or '(none)'}")
        namespaces = want
    if not namespaces:
        raise BagError(f"{bag.path}: no namespace has both draft_block and verdict topics; nothing to re-verify "
                       f"(topics: {', '.join(topics) or '(none)'})")
    for line in bag.definition_mismatches():
        raise BagError(f"type hash differs ({line}): the bag was recorded with other message definitions")

    import numpy as np
    import torch

    from wisv_ros.interfaces.convert import read_block
    from wisv_ros.interfaces.wire import WireError, hidden_head_id, read_hidden
    from wisv_ros.link.channel import SCENARIOS
    from wisv_ros.link.channel import ChannelState as LinkChannel
    from wisv_ros.sd.engines import load_lm
    from wisv_ros.sd.rounds import EdgeSessions
    from wisv_ros.sd.verification import Method
    from wisv_ros.wisv.head import ProjectedHidden

    if args.default_channel not in SCENARIOS:
        raise BagError(f"--default-channel {args.default_channel}: not one of {', '.join(SCENARIOS)}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = load_lm(args.target, args.target_backend, dtype=args.target_dtype, threads=args.threads)
    print(f"[reverify] target {args.target} ({resolve_dtype(args.target_dtype)}) loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    channel_now: list = [SCENARIOS[args.default_channel]]
    head_judge = None
    if args.head:
        from wisv_ros.wisv.head import OnnxHead, make_judge

        head = OnnxHead(args.head)
        if head.d_target != lm.hidden_size:
            raise BagError(f"--head {args.head}: expects target hidden size {head.d_target}, the target has {lm.hidden_size}")
        head_judge = make_judge(head, lambda: channel_now[0])

    reports: list[RequestReport] = []
    round_log = None
    if args.round_log:
        from wisv_ros.sd.roundlog import RoundLog

        round_log = RoundLog(args.round_log, vocab_size=lm.vocab_size)
    for ns in namespaces:
        pre = "" if ns == "/" else ns
        wanted = [t for t in (f"{pre}/draft_block", f"{pre}/verdict", f"{pre}/hidden_reply", f"{pre}/channel_state") if t in topics]
        blocks, verdicts, replies, channels = [], {}, {}, []
        for m in bag.messages(wanted):
            msg = bag.decode(m)
            kind = m.topic.rsplit("/", 1)[1]
            if kind == "draft_block":
                blocks.append((m.t_ns, msg))
            elif kind == "verdict":
                verdicts.setdefault((msg.request_id, int(msg.round_id)), msg)  # resends repeat it
            elif kind == "hidden_reply":
                replies[(msg.request_id, int(msg.round_id))] = msg
            else:
                try:
                    channels.append((m.t_ns, LinkChannel(rate_bps=msg.rate_bps, per=msg.per, rtt_s=msg.rtt_s)))
                except (TypeError, ValueError):
                    pass
        channel_times = [t for t, _ in channels]
        by_request: dict[str, RequestReport] = {}
        # The edge side of the round protocol, as verifier_node runs it (no copy rounds: a recorded
        # verdict's copied tokens are compared as recorded, not re-run).
        edge = EdgeSessions(lm, method=Method.parse(args.method), judge=head_judge, seed=args.seed, round_log=round_log)
        seen: set[tuple[str, int]] = set()

        def recorded_hiddens(req, positions):  # SH: the hiddens the drafter sent back, as recorded
            reply = replies.get((req.request_id, req.round_id))
            if reply is None:
                return None
            h, got = read_hidden(reply.hidden, "hidden_reply.hidden", positions_below=len(req.token_ids))
            head_id = hidden_head_id(reply.hidden, "hidden_reply.hidden")
            full = np.zeros((len(req.token_ids), h.shape[1]), np.float32)
            full[got] = h
            return ProjectedHidden(full, head_id) if head_id else full  # a drafter projection (pre-projected FH)

        for t_ns, b in blocks:
            rid, rnd = b.request_id, int(b.round_id)
            rep = by_request.setdefault(rid, RequestReport(ns, rid))
            if (rid, rnd) in seen:
                rep.skip("resent block")
                continue
            seen.add((rid, rnd))
            rec = verdicts.get((rid, rnd))
            if rec is None:
                rep.skip("no verdict recorded")
                continue
            if rec.error:
                rep.skip("verdict error recorded")
                continue
            rep.rounds += 1
            rep.committed += len(rec.committed_ids)
            if len(b.context_ids) == 0 and edge.context(rid) is None:
                rep.skip("context not recorded")
                continue
            try:
                req = read_block(b, lm.vocab_size)
            except WireError as exc:
                rep.skip(f"unreadable block ({exc})")
                continue
            before = list(req.context_ids) if req.context_ids else list(edge.context(rid))
            if req.prefix_length != len(before):
                rep.skip("prefix gap")
                continue
            i = bisect_right(channel_times, t_ns)
            channel_now[0] = channels[i - 1][1] if i else SCENARIOS[args.default_channel]
            req.copy_budget = 0
            got = edge.handle(req, fetch_hidden=recorded_hiddens)
            if got.error:
                rep.skip(f"refused ({got.error})")
                continue
            recorded_all = [int(i) for i in rec.committed_ids]
            copied = int(rec.copy_committed)
            rep.copied += copied
            own = recorded_all[: len(recorded_all) - copied]
            recorded = (own, int(rec.accepted), int(rec.correction_id), int(rec.committed_length) - copied)
            mine = (list(got.committed_ids), got.accepted, got.correction_id, got.committed_length)
            rep.compared += 1
            if mine == recorded:
                rep.equal += 1
            elif not rep.first_diff:
                rep.first_diff = (f"round {rnd}: recorded accepted {recorded[1]} committed {recorded[0]}, "
                                  f"re-computed accepted {mine[1]} committed {mine[0]}")
            # Later rounds follow the recording: the drafter drafted after the recorded commit.
            edge.rewind(rid, before + recorded_all)
        reports.extend(by_request.values())

    _print_reverify(reports)
    if round_log is not None:
        round_log.close()
        print(f"[reverify] wrote {round_log.records} rounds to {args.round_log}", file=sys.stderr)
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["namespace", "request_id", "rounds", "aal", "compared", "equal", "differ", "copy_committed",
                        "skipped", "first_diff"])
            for r in reports:
                w.writerow([r.namespace, r.request_id, r.rounds, f"{r.aal:.4f}", r.compared, r.equal,
                            r.compared - r.equal, r.copied, ";".join(f"{k}={n}" for k, n in sorted(r.skipped.items())),
                            r.first_diff])
        print(f"[reverify] wrote {args.csv}", file=sys.stderr)
    differ = sum(r.compared - r.equal for r in reports)
    compared = sum(r.compared for r in reports)
    print(f"[reverify] {compared - differ} of {compared} re-computed verdicts equal the recorded ones "
          f"({len(reports)} requests)", file=sys.stderr)
    return 1 if differ else 0


def _print_reverify(reports: list[RequestReport]) -> None:
    rows = [("namespace", "request", "rounds", "AAL", "compared", "equal", "skipped", "first difference")]
    for r in reports:
        skipped = ", ".join(f"{k} {n}" for k, n in sorted(r.skipped.items())) or "-"
        rows.append((r.namespace, r.request_id, str(r.rounds), f"{r.aal:.2f}", str(r.compared), str(r.equal),
                     skipped, r.first_diff or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


# =========================================================================== main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.bag", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("record", help="record wisv_ros topics into a new bag folder")
    r.add_argument("out", help="bag folder to create (must not exist)")
    r.add_argument("--namespace", action="append", help="record wisv_ros topics under this namespace (repeatable; default: all)")
    r.add_argument("--topics", nargs="+", help="record these topics (full names) besides any --namespace")
    r.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: until Ctrl-C / SIGTERM)")
    r.add_argument("--poll", type=float, default=0.5, help="look for new topics this often (s; default %(default)s)")
    r.add_argument("--progress", type=float, default=1.0, help="progress line this often (s; default %(default)s)")

    q = sub.add_parser("replay", help="publish a bag's messages with the recorded spacing")
    q.add_argument("bag", help="bag folder")
    q.add_argument("--topics", nargs="+", help="replay only these topics (default: all)")
    q.add_argument("--remap", action="append", metavar="OLD:=NEW",
                   help="publish topic (or namespace) OLD as NEW, e.g. /robot:=/replay (repeatable)")
    q.add_argument("--rate", type=float, default=1.0, help="speed factor (2 = twice as fast; default %(default)s)")
    q.add_argument("--loop", action="store_true", help="replay again and again until Ctrl-C")
    q.add_argument("--wait-for-subscribers", type=float, default=0.0, metavar="S",
                   help="before the first message, wait up to S s until every topic has a subscriber (default: no wait)")

    i = sub.add_parser("info", help="topics, types, counts, duration of a bag")
    i.add_argument("bag", help="bag folder")

    v = sub.add_parser("reverify", help="re-run verification of the recorded draft blocks; compare with the recorded verdicts")
    v.add_argument("bag", help="bag folder")
    v.add_argument("--target", required=True, help="target model spec, as the verifier_node's target_model")
    v.add_argument("--target-dtype", default="auto", choices=WEIGHT_DTYPES, help="as the verifier_node's target_dtype (default %(default)s)")
    v.add_argument("--head", default=None, help="WISV decision head .onnx the verifier used (default: none, as the node without head_path)")
    v.add_argument("--target-backend", default="torch", choices=BACKENDS, help="engine of the target (default %(default)s)")
    v.add_argument("--method", default="greedy", choices=["greedy", "reject", "wisv"],
                   help="method of blocks whose method field is empty (the verifier's 'method' parameter; default %(default)s)")
    v.add_argument("--seed", type=int, default=0, help="the verifier's 'seed' parameter (method reject; default %(default)s)")
    v.add_argument("--default-channel", default="20mbps_50ms", help="channel before the first recorded channel_state (default %(default)s)")
    v.add_argument("--namespace", action="append", help="only this namespace (repeatable; default: every one with draft_block and verdict)")
    v.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    v.add_argument("--csv", default=None, help="also write the per-request table to this CSV file")
    v.add_argument("--round-log", default=None, help="write the re-run rounds as a round log (JSON lines, wisv_ros.sd.roundlog)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. Arguments from ``--ros-args`` on go to rclpy only (record, replay), e.g.
    ``--ros-args -p use_sim_time:=true``; rclpy never sees this tool's own ``--remap OLD:=NEW``
    (rcl would otherwise take ``OLD:=NEW`` for a deprecated-syntax remapping rule)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--ros-args") if "--ros-args" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    args.rclpy_args = ["wisv_ros.cli.bag", *argv[cut:]]
    run = {"record": _record, "replay": _replay, "info": _info, "reverify": _reverify}[args.command]
    try:
        return run(args)
    except BagError as exc:
        _fail(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
