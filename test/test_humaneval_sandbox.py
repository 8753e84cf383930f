"""The HumanEval sandbox of wisv_ros.eval.datasets.humaneval_pass: untrusted completions that loop, delete files
outside the sandbox, open sockets, exit early or spawn processes are stopped and scored as failures.

Every attack is followed by the canonical solution, so that a completion fails only because the sandbox blocked
the attack; where the attack has a side effect outside the child (a deleted file, an accepted connection, a marker
file written by a subprocess), the test checks that it did not happen.  The security tests run twice: with the
layers probed on this machine (a network namespace where ``unshare`` works) and with the in-process guard alone
(what other machines fall back to).
"""

import os
import select
import socket
import time

import pytest

from wisv_ros.eval import datasets as D


@pytest.fixture(scope="module")
def humaneval():
    try:
        problems = D.load_humaneval(limit=3)
    except D.DatasetUnavailableError as e:
        pytest.skip(str(e))
    assert [p.id for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    return problems


@pytest.fixture(params=["probed", "guard_only"])
def sandbox(request, monkeypatch):
    """The sandbox layers in force: as probed here, or the in-process guard and the resource limits only."""
    if request.param == "guard_only":
        monkeypatch.setattr(D, "_sandbox", D._Sandbox())
    return D.humaneval_isolation()


def _attack(problem, code: str) -> str:
    """A completion that runs ``code`` (one statement per line, no indentation) first, then the canonical solution."""
    lines = "".join(f"    {line}\n" for line in code.strip().splitlines())
    return lines + problem.extra["canonical_solution"]


@pytest.fixture
def victim(tmp_path):
    """A file and a folder outside the sandbox, which completions must not be able to damage."""
    folder = tmp_path / "precious"
    folder.mkdir()
    path = folder / "data.txt"
    path.write_text("keep me\n")
    return path


def _intact(path) -> bool:
    return path.is_file() and path.read_text() == "keep me\n"


def test_layers_reported(humaneval):
    layers = D.humaneval_isolation()
    assert {"rlimits", "tmpdir", "guard"} <= set(layers), layers
    assert set(layers) <= {"uid", "netns", "rlimits", "tmpdir", "guard"}, layers
    assert D.humaneval_isolation() == layers  # probed once, cached


def test_reported_network_namespace_is_real(humaneval):
    if "netns" not in D.humaneval_isolation():
        pytest.skip("no network namespace on this machine (unshare missing or not permitted)")
    own = os.readlink("/proc/self/ns/net")
    p = humaneval[0]
    assert D.humaneval_pass(p, _attack(p, f"import os\nassert os.readlink('/proc/self/ns/net') != {own!r}"))
    assert not D.humaneval_pass(p, _attack(p, f"import os\nassert os.readlink('/proc/self/ns/net') == {own!r}"))


@pytest.mark.parametrize("idx", [0, 2])
def test_canonical_passes_wrong_fails(humaneval, sandbox, idx):
    p = humaneval[idx]
    assert D.humaneval_pass(p, p.extra["canonical_solution"])
    assert not D.humaneval_pass(p, "    return None\n")


def test_hand_written_solution_passes(humaneval, sandbox):
    p = humaneval[0]  # has_close_elements
    good = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    assert D.humaneval_pass(p, good)
    assert not D.humaneval_pass(p, "    return any(abs(a - b) <= threshold for a in numbers for b in numbers)\n")


def test_infinite_loop_is_stopped(humaneval, sandbox):
    p = humaneval[0]
    t0 = time.monotonic()
    assert not D.humaneval_pass(p, "    while True:\n        pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 3.0, elapsed


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.remove({path!r})",
        "import os\nos.unlink({path!r})",
        "import shutil\nshutil.rmtree({folder!r})",
        "import pathlib\npathlib.Path({path!r}).unlink()",
        "import os\nos.rename({path!r}, {path!r} + '.moved')",
        "import shutil\nshutil.move({path!r}, 'stolen.txt')",
        "import os\nos.truncate({path!r}, 0)",
        "open({path!r}, 'w').close()",
        "import pathlib\npathlib.Path({path!r}).write_text('gone')",
        "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_TRUNC))",
        "import os\nos.chmod({path!r}, 0)",
        "import os\nos.system('rm -f {path}')",
    ],
)
def test_damage_outside_the_sandbox_fails(humaneval, sandbox, victim, code):
    p = humaneval[0]
    completion = _attack(p, code.format(path=str(victim), folder=str(victim.parent)))
    assert not D.humaneval_pass(p, completion)
    assert _intact(victim)
    assert (victim.stat().st_mode & 0o777) != 0
    assert not os.path.exists(str(victim) + ".moved")


def test_files_inside_the_sandbox_are_writable(humaneval, sandbox):
    p = humaneval[0]
    scratch = "with open('scratch.txt', 'w') as f:\n    f.write('x' * 1000)\nassert open('scratch.txt').read() == 'x' * 1000"
    assert D.humaneval_pass(p, _attack(p, scratch))
    # RLIMIT_FSIZE: a file over the limit cannot be written
    big = f"with open('big.bin', 'wb') as f:\n    f.write(b'x' * {2 * D._SANDBOX_FILE_BYTES})"
    assert not D.humaneval_pass(p, _attack(p, big))


def test_child_environment_is_private(humaneval, sandbox, monkeypatch):
    monkeypatch.setenv("WISV_SANDBOX_SECRET", "do-not-leak")
    p = humaneval[0]
    code = (
        "import os\n"
        "cwd = os.path.realpath(os.getcwd())\n"
        "assert os.path.basename(cwd).startswith('wisv_humaneval_')\n"
        "assert os.path.realpath(os.environ['HOME']) == cwd and os.path.realpath(os.environ['TMPDIR']) == cwd\n"
        "assert 'WISV_SANDBOX_SECRET' not in os.environ"
    )
    assert D.humaneval_pass(p, _attack(p, code))


def test_cpu_time_limit_follows_timeout(humaneval, sandbox):
    p = humaneval[0]
    # ceil(1.5) + 1 = 3 s soft limit (a backstop: the wall-clock timeout normally fires first)
    code = (
        "line = [x for x in open('/proc/self/limits') if x.startswith('Max cpu time')][0]\n"
        "assert line.split()[3:5] == ['3', '4'], line"
    )
    assert D.humaneval_pass(p, _attack(p, code), timeout_s=1.5)
    assert not D.humaneval_pass(p, _attack(p, code), timeout_s=4.0)


class _Listener:
    """A listening TCP socket on 127.0.0.1 in the test process; :meth:`accepted` tells whether anyone connected."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()
        self.port = self.address[1]

    def accepted(self) -> bool:
        ready, _, _ = select.select([self.sock], [], [], 0.2)
        if not ready:
            return False
        conn, _ = self.sock.accept()
        conn.close()
        return True


@pytest.fixture
def listener():
    lst = _Listener()
    yield lst
    lst.sock.close()


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()",
        "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))",
        "import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
    ],
)
def test_network_access_fails(humaneval, sandbox, listener, code):
    p = humaneval[0]
    port = listener.port
    assert not D.humaneval_pass(p, _attack(p, code.format(port=port)))
    assert not listener.accepted()


def test_listener_fixture_sees_connections(listener):
    """The check above can fail: a connection from this process is seen."""
    socket.create_connection(listener.address, timeout=2).close()
    assert listener.accepted()


def test_network_namespace_stops_guard_bypass(humaneval, listener):
    """Re-importing ``_socket`` undoes the in-process guard; the network namespace still leaves nothing reachable."""
    if "netns" not in D.humaneval_isolation():
        pytest.skip("no network namespace on this machine (unshare missing or not permitted)")
    p = humaneval[0]
    port = listener.port
    code = (
        "import sys\n"
        "del sys.modules['_socket']\n"
        "import _socket\n"
        "s = _socket.socket()\n"
        "s.settimeout(2)\n"
        f"s.connect(('127.0.0.1', {port}))"
    )
    assert not D.humaneval_pass(p, _attack(p, code))
    assert not listener.accepted()


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)",
        "raise SystemExit(0)",
        "import os\nos._exit(0)",
        "exit()",
    ],
)
def test_early_exit_fails(humaneval, sandbox, code):
    p = humaneval[0]
    assert not D.humaneval_pass(p, _attack(p, code))


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['touch', {marker!r}])",
        "import subprocess\nsubprocess.Popen(['touch', {marker!r}]).wait()",
        "import os\nos.system('touch {marker}')",
        "import os\nos.popen('touch {marker}').read()",
        "import os\nos.spawnlp(os.P_WAIT, 'touch', 'touch', {marker!r})",
        "import os\nif os.fork() == 0:\n    open({marker!r}, 'w').close()\n    os._exit(0)",
        "import os\nos.execvp('touch', ['touch', {marker!r}])",
        "import multiprocessing\nq = multiprocessing.Process(target=print)\nq.start()\nq.join()",
    ],
)
def test_spawning_processes_fails(humaneval, sandbox, tmp_path, code):
    marker = tmp_path / "spawned"
    p = humaneval[0]
    assert not D.humaneval_pass(p, _attack(p, code.format(marker=str(marker))))
    time.sleep(0.05)  # a detached child would have had time to write the marker
    assert not marker.exists()
