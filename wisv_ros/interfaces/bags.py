"""rosbag2 folders of wisv_ros messages, read and written with ``rosbags`` (pure Python, no rclpy).

What a robot's ``ros2 bag info/play`` reads: a folder with ``metadata.yaml`` (rosbag2 format
version 9) and one ``.mcap`` file; every topic carries its type name, its message definition
(``ros2msg`` text, the type's own definition followed by those it uses) and its type hash
(``RIHS01_...``, computed the way rosidl computes it; checked against the hashes the generated
``wisv_ros.msg`` types carry in ``test/test_bags.py``).

The type store is rosbags' ROS 2 "kilted" store (std_msgs, builtin_interfaces, ... as the
wheels here ship them) with every ``wisv_ros/msg/*`` type registered from the ``.msg`` files:
those installed with the generated interfaces (``<prefix>/share/wisv_ros/msg`` on
``AMENT_PREFIX_PATH``; they match the types rclpy uses), else the ``msg/`` folder of this checkout.

    store = typestore()
    with BagWriter("run1") as bag:                      # a new folder; never overwrites
        bag.add_topic("/robot/verdict", "wisv_ros/msg/Verdict")
        bag.write("/robot/verdict", t_ns, raw_cdr_bytes)
    bag = open_bag("run1")                              # BagError naming the problem if it is not one
    for m in bag.messages(topics=["/robot/verdict"]):   # time order
        verdict = bag.decode(m)

Compare decoded values, not raw bytes: FastCDR leaves alignment padding uninitialised, so two
serialisations of equal messages can differ in their padding bytes.

No rclpy here: this module is part of the ROS-free core (the rclpy side is ``wisv_ros.cli.bag``).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

__all__ = [
    "BAG_VERSION",
    "BagError",
    "BagMessage",
    "BagReader",
    "BagWriter",
    "QosSpec",
    "TopicInfo",
    "msg_dir",
    "open_bag",
    "to_plain",
    "type_hash",
    "typestore",
    "wisv_types",
]

BAG_VERSION = 9  # rosbag2 metadata version written (Iron and newer; type hashes in the metadata)
PACKAGE = "wisv_ros"
_SOURCE_MSG_DIR = Path(__file__).resolve().parents[1] / "msg"


class BagError(ValueError):
    """A bag cannot be read or written; the message names the path or topic and what to do."""


# --------------------------------------------------------------------------- types
def msg_dir() -> Path:
    """The folder of ``wisv_ros`` ``.msg`` files the type store is built from.

    First ``<prefix>/share/wisv_ros/msg`` for each prefix on ``AMENT_PREFIX_PATH`` (the definitions
    the generated Python types were built from), else ``msg/`` of this source checkout.
    """
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if prefix:
            d = Path(prefix) / "share" / PACKAGE / "msg"
            if any(d.glob("*.msg")):
                return d
    if any(_SOURCE_MSG_DIR.glob("*.msg")):
        return _SOURCE_MSG_DIR
    raise BagError(
        f"no {PACKAGE} .msg files found: neither share/{PACKAGE}/msg on AMENT_PREFIX_PATH nor "
        f"{_SOURCE_MSG_DIR}; source the workspace (or tools/env.sh) that built the interfaces"
    )


@functools.lru_cache(maxsize=4)
def _typestore(folder: str):
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for f in sorted(Path(folder).glob("*.msg")):
        types.update(get_types_from_msg(f.read_text(encoding="utf-8"), f"{PACKAGE}/msg/{f.stem}"))
    store.register(types)
    return store


def typestore(folder: str | Path | None = None):
    """rosbags type store: ROS 2 kilted types + every ``wisv_ros/msg/*`` from ``folder`` (default
    :func:`msg_dir`). Cached per folder."""
    return _typestore(str(Path(folder) if folder is not None else msg_dir()))


def wisv_types(store=None) -> list[str]:
    """The registered ``wisv_ros/msg/*`` type names."""
    store = store or typestore()
    return sorted(t for t in store.fielddefs if t.startswith(f"{PACKAGE}/msg/"))


def type_hash(msgtype: str, store=None) -> str:
    """The RIHS01 type hash of ``msgtype`` (``RIHS01_<64 hex>``), as rosidl computes it."""
    store = store or typestore()
    if msgtype not in store.fielddefs:
        raise BagError(f"type {msgtype}: unknown to the type store (known wisv_ros types: {', '.join(wisv_types(store))})")
    return store.hash_rihs01(msgtype)


def to_plain(value):
    """Nested plain Python values (dicts, lists, numbers, str) of a decoded message.

    Works for rosbags messages (dataclasses, numpy arrays) and rclpy messages (``__slots__`` with
    ``get_fields_and_field_types``, ``array.array``) alike, so the two can be compared.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # ROS field names start lowercase; rosbags lists the constants (upper case) as fields too.
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name[:1].islower()}
    if hasattr(type(value), "get_fields_and_field_types"):
        return {name: to_plain(getattr(value, name)) for name in type(value).get_fields_and_field_types()}
    if isinstance(value, (str, bytes)):
        return value if isinstance(value, str) else list(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, (list, tuple)) or hasattr(value, "typecode"):  # array.array
        return [to_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------- QoS
@dataclasses.dataclass(frozen=True)
class QosSpec:
    """The QoS fields that decide compatibility, as the bag's metadata spells them.

    history: ``keep_last``, ``keep_all`` or ``unknown`` (DDS discovery does not carry the
    publisher's history: rosbag2 records ``unknown`` with depth 0 too); reliability:
    ``reliable`` / ``best_effort``; durability: ``volatile`` / ``transient_local``.
    """

    history: str = "keep_last"
    depth: int = 10
    reliability: str = "reliable"
    durability: str = "volatile"

    def to_rosbags(self):
        from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

        infinite = QosTime(9223372036, 854775807)  # what rosbag2 writes for an infinite duration
        return Qos(
            history=QosHistory[self.history.upper()],
            depth=int(self.depth),
            reliability=QosReliability[self.reliability.upper()],
            durability=QosDurability[self.durability.upper()],
            deadline=infinite,
            lifespan=infinite,
            liveliness=QosLiveliness.AUTOMATIC,
            liveliness_lease_duration=infinite,
            avoid_ros_namespace_conventions=False,
        )

    @classmethod
    def from_rosbags(cls, qos) -> "QosSpec":
        return cls(history=qos.history.name.lower(), depth=int(qos.depth),
                   reliability=qos.reliability.name.lower(), durability=qos.durability.name.lower())


# --------------------------------------------------------------------------- writing
class BagWriter:
    """A new rosbag2 folder (version 9, mcap storage) of serialized (CDR) messages.

    Args:
        path: the bag folder to create; it must not exist (a bag is never overwritten).
        store: type store that defines the types (default :func:`typestore`).

    Use as a context manager, or ``open()`` / ``close()``: ``metadata.yaml`` is written on close,
    so a recorder must close the bag on every way out (``ros2 bag reindex`` rebuilds it otherwise).
    """

    def __init__(self, path: str | Path, store=None):
        from rosbags.rosbag2 import StoragePlugin, Writer

        self.path = Path(path)
        if self.path.exists():
            raise BagError(f"{self.path}: exists already; a bag is never overwritten, choose a new folder")
        if not self.path.parent.is_dir():
            raise BagError(f"{self.path}: parent folder {self.path.parent} does not exist")
        self.store = store or typestore()
        self._writer = Writer(self.path, version=BAG_VERSION, storage_plugin=StoragePlugin.MCAP)
        self._conns: dict[str, object] = {}
        self.counts: dict[str, int] = {}
        self._open = False

    def open(self) -> "BagWriter":
        self._writer.open()
        self._open = True
        return self

    def add_topic(self, topic: str, msgtype: str, offered_qos: Sequence[QosSpec] = ()) -> None:
        """Register ``topic`` of ``msgtype`` (a type of the store) with the publishers' offered QoS."""
        if topic in self._conns:
            raise BagError(f"topic {topic}: added twice")
        type_hash(msgtype, self.store)  # BagError naming the type if the store lacks it
        self._conns[topic] = self._writer.add_connection(
            topic, msgtype, typestore=self.store, offered_qos_profiles=[q.to_rosbags() for q in offered_qos])
        self.counts[topic] = 0

    def write(self, topic: str, t_ns: int, data: bytes) -> None:
        """Append one serialized message received at ``t_ns`` (ns since the epoch)."""
        conn = self._conns.get(topic)
        if conn is None:
            raise BagError(f"topic {topic}: not added to the bag (add_topic first)")
        self._writer.write(conn, int(t_ns), bytes(data))
        self.counts[topic] += 1

    def close(self) -> None:
        if self._open:
            self._open = False
            self._writer.close()

    def __enter__(self) -> "BagWriter":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()  # also on an exception: what was recorded stays readable


# --------------------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True)
class TopicInfo:
    name: str
    msgtype: str
    count: int
    type_hash: str  # as recorded in the bag
    offered_qos: tuple[QosSpec, ...]


@dataclasses.dataclass(frozen=True)
class BagMessage:
    topic: str
    msgtype: str
    t_ns: int  # reception time when recorded (ns since the epoch)
    data: bytes  # serialized CDR


class BagReader:
    """An open rosbag2 folder (any version and storage rosbags reads); see :func:`open_bag`."""

    def __init__(self, path: str | Path, store=None):
        from rosbags.rosbag2 import Reader
        from rosbags.rosbag2.errors import ReaderError

        self.path = Path(path)
        if not self.path.exists():
            raise BagError(f"{self.path}: no such bag folder")
        if not self.path.is_dir():
            raise BagError(f"{self.path}: not a folder; a rosbag2 bag is a folder holding metadata.yaml and its storage file(s)")
        if not (self.path / "metadata.yaml").is_file():
            raise BagError(f"{self.path}: not a rosbag2 bag (no metadata.yaml in it); if a recording was killed, "
                           "rebuild it with 'ros2 bag reindex' on a machine with ROS 2")
        self.store = store or typestore()
        try:
            self._reader = Reader(self.path)
            self._reader.open()
        except (ReaderError, OSError, KeyError, ValueError) as exc:
            raise BagError(f"{self.path}: cannot read the bag: {exc}") from None
        from ruamel.yaml import YAML  # rosbags' own YAML library

        info = YAML(typ="safe").load((self.path / "metadata.yaml").read_text(encoding="utf-8"))
        info = info.get("rosbag2_bagfile_information", {}) if isinstance(info, dict) else {}
        self.version = int(info.get("version", 0))
        self.storage = str(info.get("storage_identifier", ""))
        self._by_topic: dict[str, list] = {}
        for conn in self._reader.connections:
            self._by_topic.setdefault(conn.topic, []).append(conn)

    # -- summary
    @property
    def start_ns(self) -> int:
        return int(self._reader.start_time) if self.message_count else 0

    @property
    def duration_ns(self) -> int:
        return int(self._reader.duration) if self.message_count > 1 else 0

    @property
    def message_count(self) -> int:
        return int(self._reader.message_count)

    def topics(self) -> list[TopicInfo]:
        out = []
        for name, conns in sorted(self._by_topic.items()):
            qos = tuple(QosSpec.from_rosbags(q) for c in conns for q in getattr(c.ext, "offered_qos_profiles", []))
            out.append(TopicInfo(name, conns[0].msgtype, sum(c.msgcount for c in conns), conns[0].digest, qos))
        return out

    def check_topics(self, topics: Iterable[str]) -> list[str]:
        """``topics`` if the bag has them all, else a BagError naming the missing ones."""
        topics = list(topics)
        missing = [t for t in topics if t not in self._by_topic]
        if missing:
            raise BagError(f"topic {', '.join(missing)}: not in the bag {self.path}; its topics are: "
                           f"{', '.join(sorted(self._by_topic)) or '(none)'}")
        return topics

    # -- messages
    def messages(self, topics: Iterable[str] | None = None) -> Iterator[BagMessage]:
        """Messages in reception-time order, of ``topics`` (all when None)."""
        wanted = self.check_topics(topics) if topics is not None else list(self._by_topic)
        conns = [c for t in wanted for c in self._by_topic[t]]
        if not conns:
            return
        for conn, t_ns, data in self._reader.messages(connections=conns):
            yield BagMessage(conn.topic, conn.msgtype, int(t_ns), bytes(data))

    def decode(self, msg: BagMessage):
        """The message as a rosbags dataclass (numeric arrays as numpy arrays)."""
        if msg.msgtype not in self.store.fielddefs:
            raise BagError(f"topic {msg.topic}: type {msg.msgtype} is unknown to the type store; "
                           f"only {PACKAGE} and standard ROS 2 types can be decoded")
        return self.store.deserialize_cdr(msg.data, msg.msgtype)

    def definition_mismatches(self) -> list[str]:
        """Topics whose recorded type hash differs from this package's definition of the type."""
        out = []
        for info in self.topics():
            if info.msgtype in self.store.fielddefs and info.type_hash:
                ours = self.store.hash_rihs01(info.msgtype)
                if info.type_hash != ours:
                    out.append(f"{info.name} ({info.msgtype}): recorded {info.type_hash}, this package {ours}")
        return out

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "BagReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_bag(path: str | Path, store=None) -> BagReader:
    """Open a rosbag2 folder for reading; BagError naming the problem if it is not one."""
    return BagReader(path, store)
