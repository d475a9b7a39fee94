"""Whole jobs past one machine, on loopback: each "node" is its own ``accelkit run`` agent, as
on a cluster (static rendezvous, and c10d elastic with ``--nnodes 1:N --max-restarts 3``).

What an elastic run must equal: the chain of plain launches it amounts to. The run's log
(tests/multinode_train.py) says which attempt made each step last, at which world size, and
where each attempt resumed; the chain replays those segments with plain single-agent launches
(``accelkit run --standalone``), each resuming from the last one's checkpoint. Every step's
loss (``float.hex``) and samples must be equal, and every epoch must see each sample once.

Slow tier: every test starts several agents (seconds each on 2 shared cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelkit.testing import free_port, worker_env

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("multinode_train.py")
RUN = [sys.executable, "-m", "accelkit.cli", "run"]
SAMPLES = 48
#: a safety net under load, never a timed assertion
WAIT_S = 400.0
#: rendezvous settings that keep the tests short: a round closes 5 s after its minimum joined,
#: and a dead node is dropped after 3 missed 1 s heartbeats (defaults: 30 s, 3 x 5 s)
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
#: a plain launch on one machine; restarts because the port the agent picks for the workers'
#: store (one per attempt under accelkit run) may be taken by another process before rank 0
#: binds it, on a machine this busy
PLAIN = ["--standalone", "--max-restarts", "2"]


class Job:
    """The agents of one job, each in its own session (a kill takes its workers too)."""

    def __init__(self, root: Path, steps: int, extra: list[str] | None = None) -> None:
        self.root, self.steps, self.extra = root, steps, extra or []
        self.ckpt, self.log = root / "ckpt", root / "log"
        self.ckpt.mkdir(parents=True, exist_ok=True)
        self.log.mkdir(parents=True, exist_ok=True)
        self.agents: dict[str, subprocess.Popen] = {}
        self.port = free_port()

    def script_args(self) -> list[str]:
        where = ["--ckpt", str(self.ckpt), "--log", str(self.log), "--steps", str(self.steps)]
        return [str(SCRIPT), *where, *self.extra]

    def start(self, name: str, flags: list[str], cwd: Path | None = None) -> None:
        out = open(self.root / f"agent-{name}.log", "a")  # noqa: SIM115 (closed in finish)
        self.agents[name] = subprocess.Popen(
            [*RUN, *flags, *self.script_args()],
            env=worker_env({"PYTHONPATH": _pythonpath()}),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
        out.close()

    def start_elastic(self, name: str, nnodes: str) -> None:
        self.start(
            name,
            [
                *("--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
                *("--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "job"),
                *("--max-restarts", "3", "--monitor-interval", "1", "--rdzv-conf", RDZV_CONF),
            ],
        )

    def kill(self, name: str) -> None:
        """The node is gone: its agent and its workers (torchrun starts each worker in a
        session of its own), at once."""
        for pid in _tree(self.agents[name].pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.agents[name].wait(60)

    def output(self, name: str) -> str:
        return (self.root / f"agent-{name}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- agent {n} ---\n{self.output(n)[-4000:]}" for n in self.agents)

    def events(self) -> list[dict]:
        path = self.log / "steps.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, what: str, test) -> list[dict]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            events = self.events()
            if test(events):
                return events
            if all(agent.poll() is not None for agent in self.agents.values()):
                break  # every agent ended: it will not come
            time.sleep(0.1)
        raise AssertionError(f"never saw {what}\n{self.outputs()}")

    def finish(self) -> dict[str, int]:
        codes = {}
        try:
            for name, agent in self.agents.items():
                codes[name] = agent.wait(WAIT_S)
        finally:
            self.stop_all()
        return codes

    def stop_all(self) -> None:
        for name, agent in self.agents.items():
            if agent.poll() is None:
                self.kill(name)


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def static(nodes: int, node: int, port: int, restarts: int = 2) -> list[str]:
    """One agent of a static job of ``nodes`` nodes, one process each (restarts: see PLAIN)."""
    return [
        *("--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", "1"),
        *("--max-restarts", str(restarts)),
        *("--master-addr", "127.0.0.1", "--master-port", str(port)),
    ]


def _pythonpath() -> str:
    """The checkout first, so the agents run this tree's accelkit (as pytest does)."""
    here = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])


def steps_made(events: list[dict], world: int, at_least: int, after: int = 0) -> bool:
    """Whether one attempt at ``world`` ranks made ``at_least`` steps, among events[after:]."""
    counts: dict[str, int] = {}
    for e in events[after:]:
        if e["event"] == "step" and e["world"] == world:
            counts[e["attempt"]] = counts.get(e["attempt"], 0) + 1
    return any(n >= at_least for n in counts.values())


def winners(events: list[dict]) -> tuple[dict[int, dict], list[tuple[int, int, int]]]:
    """Each step as the last attempt to make it logged it, and the segments of the chain:
    (world, first step, last step) of each attempt that won steps, in order."""
    final: dict[int, dict] = {}
    for e in events:
        if e["event"] == "step":
            final[e["step"]] = e
    segments: list[tuple[int, int, int]] = []
    owner = None
    for step in sorted(final):
        e = final[step]
        if e["attempt"] != owner:
            segments.append((e["world"], step, step))
            owner = e["attempt"]
        else:
            world, first, _ = segments[-1]
            segments[-1] = (world, first, step)
    return final, segments


def check_chain(job: Job, tmp: Path) -> list[tuple[int, int, int]]:
    """The run's steps equal a chain of plain launches, and each epoch sees every sample once."""
    final, segments = winners(job.events())
    assert sorted(final) == list(range(1, job.steps + 1)), segments
    starts = {e["attempt"]: e for e in job.events() if e["event"] == "start"}
    for e in (final[first] for _, first, _ in segments):  # each attempt resumed where the
        expected = None if e["step"] == 1 else e["step"] - 1  # previous segment ended
        assert starts[e["attempt"]]["resumed"] == expected, (segments, starts[e["attempt"]])
    chain = Job(tmp / "chain", job.steps)
    for world, _, last in segments:
        chain.extra = ["--stop-at", str(last)] if last < job.steps else []
        chain.start(f"plain-{last}", [*PLAIN, "--nproc-per-node", str(world)])
        assert chain.finish()[f"plain-{last}"] == 0, chain.outputs()
    replay, replay_segments = winners(chain.events())
    assert [w for w, _, _ in replay_segments] == [w for w, _, _ in segments]
    for step in final:
        assert (final[step]["loss"], final[step]["samples"]) == (
            replay[step]["loss"],
            replay[step]["samples"],
        ), f"step {step} differs from the chain of plain launches {segments}"
    order = [i for step in sorted(final) for i in final[step]["samples"]]
    for epoch in range(len(order) // SAMPLES):
        assert sorted(order[epoch * SAMPLES : (epoch + 1) * SAMPLES]) == list(range(SAMPLES))
    return segments


# ---- static ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", [2, 3])
def test_static_agents_equal_one_plain_launch_of_the_same_world(tmp_path, nodes):
    job = Job(tmp_path / "job", steps=2 * SAMPLES // (4 * nodes))  # two epochs
    port = free_port()
    for node in range(nodes):
        job.start(
            f"n{node}",
            static(nodes, node, port),
        )
    codes = job.finish()
    assert set(codes.values()) == {0}, job.outputs()
    assert check_chain(job, tmp_path) == [(nodes, 1, job.steps)]


# ---- elastic ---------------------------------------------------------------------------------------
def test_a_node_killed_and_started_again_leaves_the_run_equal_to_its_chain(tmp_path):
    job = Job(tmp_path / "job", steps=18, extra=["--hold-after", "2"])
    (job.log / "hold-2").touch()  # each attempt waits after 2 steps until the test lets it go
    (job.log / "hold-1").touch()
    job.start_elastic("a", "1:2")  # a hosts the rendezvous: started first, never killed
    time.sleep(2)
    job.start_elastic("b", "1:2")
    job.wait_for("2 steps at world 2", lambda ev: steps_made(ev, 2, 2))
    killed_at = len(job.events())
    job.kill("b")
    lost = time.monotonic()
    (job.log / "hold-2").unlink()  # a's next collective meets the dead peer
    job.wait_for("2 steps at world 1", lambda ev: steps_made(ev, 1, 2, killed_at))
    recovered = time.monotonic() - lost
    back_at = len(job.events())
    job.start_elastic("b", "1:2")  # the node comes back: a's agent restarts its workers
    job.wait_for("a world-2 attempt again", lambda ev: steps_made(ev, 2, 1, back_at))
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, job.outputs()
    assert job.events()[-1]["event"] == "done"
    segments = check_chain(job, tmp_path)
    assert [w for w, _, _ in segments] == [2, 1, 2], segments
    print(f"world 2 -> 1 after a node was lost: 2 steps made at world 1 {recovered:.1f} s later")


def test_a_worker_crash_restarts_and_resumes_equal_to_its_chain(tmp_path):
    job = Job(tmp_path / "job", steps=12, extra=["--crash", "1:3"])
    job.start_elastic("a", "1:2")
    time.sleep(2)
    job.start_elastic("b", "1:2")
    codes = job.finish()
    assert codes == {"a": 0, "b": 0}, job.outputs()
    assert (job.log / "crashed").exists()
    segments = check_chain(job, tmp_path)
    assert len(segments) >= 2, segments  # the crash cost an attempt


def test_sigterm_to_one_of_three_nodes_the_other_two_go_on(tmp_path):
    job = Job(tmp_path / "job", steps=12, extra=["--hold-after", "2"])
    (job.log / "hold-3").touch()
    job.start_elastic("a", "1:3")
    time.sleep(2)
    job.start_elastic("b", "1:3")
    job.start_elastic("c", "1:3")
    job.wait_for("2 steps at world 3", lambda ev: steps_made(ev, 3, 2))
    os.kill(job.agents["c"].pid, signal.SIGTERM)  # the agent passes it on to its worker
    codes = job.finish()
    assert codes == {"a": 0, "b": 0, "c": 143}, job.outputs()
    assert "accelkit run: stopped by SIGTERM; exit status 143" in job.output("c")
    assert "Traceback" not in job.output("c")
    assert "exits with status 75" in job.output("a") + job.output("b")
    assert job.events()[-1]["event"] == "done"  # the survivors finished the work
    segments = check_chain(job, tmp_path)
    assert [w for w, _, _ in segments] == [3, 2], segments


def test_sigterm_to_every_node_saves_one_step_and_stops(tmp_path):
    job = Job(tmp_path / "job", steps=12, extra=["--hold-after", "2"])
    (job.log / "hold-2").touch()
    job.start_elastic("a", "1:2")
    time.sleep(2)
    job.start_elastic("b", "1:2")
    job.wait_for("2 steps at world 2", lambda ev: steps_made(ev, 2, 2))
    for agent in job.agents.values():
        os.kill(agent.pid, signal.SIGTERM)
    codes = job.finish()
    assert codes == {"a": 143, "b": 143}, job.outputs()
    stops = [e for e in job.events() if e["event"] == "stop"]
    assert [s["step"] for s in stops] == [2]
    assert (job.ckpt / "step-2" / "accelkit.json").is_file()
    # (a node whose signal came a moment after the other's may first decide to go on; its
    # agent, signalled too, ends 143 all the same: no assertion on that message)


# ---- node-private disks -------------------------------------------------------------------------
def test_node_private_disks_with_a_stale_same_named_checkpoint_are_refused(tmp_path):
    """Each node works in a folder of its own and names the checkpoints ``ckpt`` (relative):
    the same path, different contents, as on each machine's own disk."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node, seed in zip(nodes, (11, 12)):  # node1 holds a stale run of the same name
        node.mkdir()
        plain = Job(node, steps=2)
        plain.ckpt, plain.extra = Path("ckpt"), ["--seed", str(seed)]
        plain.start("plain", [*PLAIN, "--nproc-per-node", "2"], cwd=node)
        assert plain.finish() == {"plain": 0}, plain.outputs()
    assert (nodes[1] / "ckpt" / "step-2").is_dir()

    for mode, expected in (
        (["--load", "ckpt/step-2"], "rank 1 reads a different checkpoint at this path than rank 0"),
        ([], "rank(s) [1] cannot see the marker rank 0 wrote"),  # auto_resume, up front
    ):
        job = Job(tmp_path / f"job-{len(mode)}", steps=4, extra=mode)
        job.ckpt = Path("ckpt")
        port = free_port()
        for rank, node in enumerate(nodes):
            job.start(
                f"n{rank}",
                static(2, rank, port, restarts=0),  # a refusal is final
                cwd=node,
            )
        codes = job.finish()
        assert 0 not in codes.values(), job.outputs()
        assert expected in job.outputs(), job.outputs()
        assert "node-local disks?" in job.outputs()
        assert not any(e["event"] == "step" for e in job.events())  # nothing trained
    shutil.rmtree(tmp_path / "chain", ignore_errors=True)
