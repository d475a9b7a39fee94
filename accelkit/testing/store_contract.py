"""The contract every checkpoint store passes, as pytest tests a store's own suite runs.

One line per store, in a test module::

    from accelkit.testing.store_contract import store_contract

    TestS3Store = store_contract("s3")

The class runs accelkit's checkpoint calls (``accel.save`` / ``accel.load`` with the store's
URLs) against a real server on loopback behind :class:`~accelkit.testing.faultproxy.FaultProxy`
(:mod:`accelkit.testing.stores` says where each store's checkpoints go), and holds each case to
one rule: **it ends with success and the exact state, or with a clear ``CheckpointError`` and
the live state unchanged; never a wrong or torn load, never a hang**. The cases:

- round trip through ``latest``; a flipped byte and a missing rank file fail clearly and change
  nothing; asynchronous saves rotate (``keep_last``) and move ``latest``;
- one network fault (reset, cut body, 503, stall, lost answer) at each request of a load
  (``latest``, the manifest, a rank file, small and large) or of a save (a rank file, the
  conditional manifest write, ``latest``): the call succeeds, the state is exact, and the next
  save of the series commits; a fault that never ends fails clearly within the retry bound;
- two jobs saving one name, 20 times in a row: exactly one commits, the other fails with
  "another job writes here", and the committed checkpoint passes its checksums;
- a SIGKILL between the manifest's write and ``latest``'s: the next run resumes from that
  commit and saves on (never wedged);
- an object replaced under a running load (one and two ranks): refused, never loaded;
- two gloo ranks loading under faults agree on the outcome and never deadlock.

Cases marked ``slow`` are left to the slow tier; the rest take a few seconds each. A store's
known defects are listed in the class's ``xfail`` (case name -> reason): they run as strict
xfails, so a fix shows up as a failure until the entry is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from accelkit.testing import run_ranks
from accelkit.testing.faultproxy import Cut, Fault, Lose, Reset, Stall, Status
from accelkit.testing.stores import Place, open_place

__all__ = ["StoreContract", "store_contract"]

#: the phrase a losing writer's error must hold (docs/checkpoint.md, "Object storage")
ANOTHER_JOB = "another job writes here"
#: the loser's error where its save began after the other's commit, on a store that never
#: replaces a committed name: as clear, and nothing of either job is lost
COMMITTED_ALREADY = "is a committed checkpoint already"
#: a stall longer than every store's default read timeout (60 s)
STALL_PAST_TIMEOUT_S = 150.0
#: a stall longer than the short read timeout a store with the option is given
STALL_PAST_SHORT_TIMEOUT_S = 30.0
#: runs of each racy case in a row
RACE_RUNS = 20
#: rank 0's file, whatever save-unique part a store puts in its name (a regular expression)
RANK0 = r"rank-00000[\w.-]*\.safetensors"
#: the rank side of the 2-rank cases
_RANKS = "accelkit.testing.store_contract:ranks_load"
#: seconds a subprocess of a case may take (2 cores shared with other work: generous)
CHILD_TIMEOUT = 300


# ---- the workload: small, seeded, the same in every process ---------------------------------------
def _workload(seed: int, big: bool = False) -> tuple[Any, dict[str, Any]]:
    """A cpu Accelerator and a trained state ``{"model", "optimizer", "step"}`` from ``seed``
    (``big``: a rank file of about 20 MB, several 8 MiB parts)."""
    import torch

    import accelkit

    torch.manual_seed(seed)
    accel = accelkit.get("cpu")
    width = 1280 if big else 64
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    model, opt = accel.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    accel.backward(model(torch.randn(4, width)).pow(2).mean())
    accel.step()
    return accel, {"model": model, "optimizer": opt, "step": seed}


def _digest(state: dict[str, Any]) -> str:
    """SHA-256 of every tensor and number of ``state`` (model, optimizer, step), in name order."""
    import torch

    h = hashlib.sha256()
    model = state["model"]
    model = getattr(model, "module", model)
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    for index, per_param in sorted(state["optimizer"].state_dict()["state"].items()):
        for key, value in sorted(per_param.items()):
            h.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().numpy().tobytes())
            else:
                h.update(repr(value).encode())
    h.update(repr(state.get("step")).encode())
    return h.hexdigest()


def _fresh(big: bool = False) -> tuple[Any, dict[str, Any]]:
    """A state of the workload's shapes to load into (another seed: its values differ)."""
    accel, state = _workload(9999, big)
    state["step"] = -1
    return accel, state


def _outcome(fn: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Run a load into ``state``: ``ok`` or the error, with the state's digest before and after."""
    import accelkit

    before = _digest(state)
    try:
        fn()
        result: dict[str, Any] = {"ok": True}
    except accelkit.CheckpointError as err:
        result = {"ok": False, "type": type(err).__name__, "error": str(err)}
    except Exception as err:  # not a clear error: the contract fails on it
        result = {"ok": False, "type": type(err).__name__, "error": repr(err), "unclear": True}
    result.update(before=before, after=_digest(state))
    return result


def _check_load(result: dict[str, Any], want: str, must_succeed: bool) -> None:
    """The contract of one load: the exact state, or a clear error and nothing changed."""
    assert not result.get("unclear"), f"not a CheckpointError: {result['type']}: {result['error']}"
    if result["ok"]:
        assert result["after"] == want, "the load succeeded with a state that is not the saved one"
    else:
        assert must_succeed is False, f"the load failed: {result['type']}: {result['error']}"
        if result["type"] != "PartialLoadError":
            assert result["after"] == result["before"], "a failed load changed the state"


# ---- subprocesses ----------------------------------------------------------------------------------
def child(job: dict[str, Any]) -> None:
    """A subprocess of a case (``python -c``): saves as ``job`` says and writes its results."""
    if job.get("kill_at_latest"):  # disk: die between the rename and the latest pointer
        from accelkit.checkpoint.store.posix import PosixStore

        calls, real = [], PosixStore.point_latest

        def point_latest(self: Any, where: str) -> None:
            calls.append(where)
            if len(calls) >= job["kill_at_latest"]:
                os.kill(os.getpid(), signal.SIGKILL)
            real(self, where)

        PosixStore.point_latest = point_latest  # type: ignore[method-assign]
    out = Path(job["out"])
    for run, url in enumerate(job["urls"]):
        accel, state = _workload(job["seed"], job.get("big", False))
        if "steps" in job:
            state["step"] = job["steps"][run]
        if job.get("race"):  # both writers start together
            (out / f"ready-{job['seed']}-{run}").touch()
            while not (out / f"go-{run}").exists():
                time.sleep(0.005)
        try:
            accel.save(url, state, asynchronous=job.get("asynchronous", False))
            accel.wait_for_save()
            result: dict[str, Any] = {"ok": True}
        except Exception as err:
            result = {"ok": False, "type": type(err).__name__, "error": str(err)}
        result["digest"] = _digest(state)
        done = out / f"result-{job['seed']}-{run}.json"
        (out / f".{done.name}").write_text(json.dumps(result))
        os.replace(out / f".{done.name}", done)  # whole, or not there yet


def _spawn(job: dict[str, Any], env: dict[str, str]) -> subprocess.Popen:
    code = "import json, sys; from accelkit.testing.store_contract import child; child(json.loads(sys.argv[1]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(job)],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def ranks_load(url: str, want: str, big: bool = False) -> dict[str, Any]:
    """A rank of a 2-rank load (run_ranks): the outcome on this rank."""
    import torch

    import accelkit

    torch.manual_seed(9999)
    accel = accelkit.get("ddp")
    width = 1280 if big else 64
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    model, opt = accel.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    accel.backward(model(torch.randn(4, width)).pow(2).mean())
    accel.step()
    state = {"model": model, "optimizer": opt, "step": -1}
    result = _outcome(lambda: accel.load(url, state), state)
    result["rank"] = accel.rank
    result["exact"] = result["after"] == want
    return result


# ---- the cases -------------------------------------------------------------------------------------
#: one fault at a time; ``cut`` falls inside the answer's body
LOAD_FAULTS: dict[str, Fault] = {
    "reset": Reset(),
    "cut": Cut(after=3),
    "503": Status(503),
    "stall": Stall(seconds=2),
    "lost": Lose(),
}
#: (object, nth request of it): the small reads, a rank file's first read, a later part
LOAD_TARGETS = {
    "latest": (r"run/latest", 1),
    "manifest": (r"run/step-1/accelkit\.json", 1),
    "rank-first": (rf"run/step-1/{RANK0}", 1),
    "rank-later": (rf"run/step-1/{RANK0}", 2),
}
SAVE_FAULTS: dict[str, Fault] = {
    "reset": Reset(),
    "503": Status(503),
    "stall": Stall(seconds=2),
    "lost": Lose(),
}
SAVE_TARGETS = {
    "rank": rf"run/step-2/{RANK0}",
    "manifest": r"run/step-2/accelkit\.json",
    "latest": r"run/latest",
}


def _cases(faults: dict[str, Fault], targets: dict[str, Any]) -> list[Any]:
    return [pytest.param(f, t, id=f"{f}-{t}") for t in targets for f in faults]


#: which cases the default tier runs (the rest are slow)
DEFAULT_LOAD = {("reset", "rank-later"), ("cut", "latest")}
DEFAULT_SAVE = {("lost", "manifest"), ("503", "latest")}


def _load_cases() -> list[Any]:
    return [
        pytest.param(
            *p.values, id=p.id, marks=() if tuple(p.values) in DEFAULT_LOAD else pytest.mark.slow
        )
        for p in _cases(LOAD_FAULTS, LOAD_TARGETS)
    ]


def _save_cases() -> list[Any]:
    return [
        pytest.param(
            *p.values, id=p.id, marks=() if tuple(p.values) in DEFAULT_SAVE else pytest.mark.slow
        )
        for p in _cases(SAVE_FAULTS, SAVE_TARGETS)
    ]


class StoreContract:
    """The cases, run on the store :attr:`store` names (a kind of :mod:`accelkit.testing.stores`)."""

    store: ClassVar[str] = "disk"
    #: case (the test's name without ``test_``, with its parameters' id) -> reason: strict xfails
    xfail: ClassVar[dict[str, str]] = {}

    @pytest.fixture
    def place(
        self, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
    ):
        name = request.node.name
        case = name.removeprefix("test_")
        reason = self.xfail.get(case) or self.xfail.get(case.split("[")[0])
        if reason:
            request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))
        opened = open_place(self.store, name, tmp_path)
        for key, value in opened.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        yield opened
        opened.close()

    def _networked(self, place: Place) -> None:
        if not place.networked:
            pytest.skip(f"{place.kind}: no network between the client and the store")

    def _saved(
        self, place: Place, seed: int = 1, big: bool = False, name: str = "run/step-1"
    ) -> str:
        accel, state = _workload(seed, big)
        accel.save(place.url(name), state)
        return _digest(state)

    # ---- the basics ----------------------------------------------------------------------------
    def test_round_trip_follows_latest(self, place: Place) -> None:
        want = self._saved(place)
        accel, state = _fresh()
        before = _digest(state)
        accel.load(place.url("run"), state)  # the series: its latest names step-1
        assert _digest(state) == want != before and state["step"] == 1
        assert {"run/latest", "run/step-1/accelkit.json"} <= set(place.keys("run"))
        assert _rank_key(place, "run/step-1")

    def test_flipped_byte_fails_clearly_and_changes_nothing(self, place: Place) -> None:
        import accelkit

        self._saved(place)
        key = _rank_key(place, "run/step-1")
        data = bytearray(place.read(key))
        data[-3] ^= 0x01
        place.write(key, bytes(data))
        accel, state = _fresh()
        before = _digest(state)
        with pytest.raises(accelkit.CheckpointError, match=rf"{RANK0}.*checksum"):
            accel.load(place.url("run"), state)
        assert _digest(state) == before

    def test_missing_rank_file_fails_clearly(self, place: Place) -> None:
        import accelkit

        self._saved(place)
        place.delete(_rank_key(place, "run/step-1"))
        accel, state = _fresh()
        before = _digest(state)
        with pytest.raises(accelkit.CheckpointError, match=rf"{RANK0}.*missing"):
            accel.load(place.url("run"), state)
        assert _digest(state) == before

    def test_asynchronous_saves_rotate_and_move_latest(self, place: Place) -> None:
        accel, state = _workload(1)
        for step in range(1, 5):
            state["step"] = step
            accel.save(place.url(f"run/step-{step}"), state, keep_last=2, asynchronous=True)
        accel.wait_for_save()
        want = _digest(state)
        names = {k.split("/")[1] for k in place.keys("run") if k.count("/") == 2}
        assert names == {"step-3", "step-4"}
        assert place.read("run/latest").decode().strip() == "step-4"
        accel, fresh = _fresh()
        accel.load(place.url("run"), fresh)
        assert _digest(fresh) == want

    # ---- one network fault -----------------------------------------------------------------------
    @pytest.mark.parametrize(("fault", "target"), _load_cases())
    def test_one_fault_during_a_load(self, place: Place, fault: str, target: str) -> None:
        """One fault at one request of a load: it is retried; the load is exact."""
        self._networked(place)
        big = target == "rank-later"
        want = self._saved(place, big=big)
        key, nth = LOAD_TARGETS[target]
        injected = LOAD_FAULTS[fault]
        if fault == "cut" and big:
            injected = Cut(after=3 << 20)  # inside a large part
        assert place.proxy is not None
        rule = place.proxy.inject(injected, nth=nth, **place.request("read", key))
        accel, state = _fresh(big)
        result = _outcome(lambda: accel.load(place.url("run"), state), state)
        assert rule.fired == 1, f"the fault never happened: {place.proxy.requests()}"
        _check_load(result, want, must_succeed=True)

    @pytest.mark.parametrize(("fault", "target"), _save_cases())
    def test_one_fault_during_a_save(self, place: Place, fault: str, target: str) -> None:
        """One fault at one request of a save: it commits, loads exactly, and the next save of
        the series commits too (the series is not wedged)."""
        self._networked(place)
        self._saved(place)
        assert place.proxy is not None
        rule = place.proxy.inject(
            SAVE_FAULTS[fault], **place.request("write", SAVE_TARGETS[target])
        )
        accel, state = _workload(2)
        accel.save(place.url("run/step-2"), state)
        assert rule.fired == 1, f"the fault never happened: {place.proxy.requests()}"
        want = _digest(state)
        accel, fresh = _fresh()
        accel.load(place.url("run"), fresh)
        assert _digest(fresh) == want and fresh["step"] == 2
        accel3, state3 = _workload(3)
        accel3.save(place.url("run/step-3"), state3)
        accel, fresh = _fresh()
        accel.load(place.url("run"), fresh)
        assert fresh["step"] == 3

    @pytest.mark.slow
    def test_a_stall_past_the_read_timeout_is_retried(self, place: Place) -> None:
        """The manifest's GET answers nothing for longer than the store's read timeout: the
        client gives up on it and asks again; the load succeeds, never hangs. A store with a
        ``read_timeout`` option (:attr:`Place.short_read_timeout`) is given a short one and a
        stall of :data:`STALL_PAST_SHORT_TIMEOUT_S`; any other, :data:`STALL_PAST_TIMEOUT_S`."""
        self._networked(place)
        want = self._saved(place)
        assert place.proxy is not None
        options = place.short_read_timeout
        stall = STALL_PAST_TIMEOUT_S if options is None else STALL_PAST_SHORT_TIMEOUT_S
        rule = place.proxy.inject(
            Stall(seconds=stall, lose=True),
            **place.request("read", r"run/step-1/accelkit\.json"),
        )
        accel, state = _fresh()
        started = time.monotonic()
        result = _outcome(
            lambda: accel.load(place.url("run"), state, storage_options=options), state
        )
        assert rule.fired == 1
        _check_load(result, want, must_succeed=True)
        assert time.monotonic() - started < stall, "the client waited out the stall"

    @pytest.mark.slow
    @pytest.mark.parametrize("op", ["load", "save"])
    def test_a_fault_that_never_ends_fails_clearly(self, place: Place, op: str) -> None:
        """Every request of the rank file fails: a clear error within the retry bound; a load
        changes nothing, a save commits nothing and leaves ``latest`` alone."""
        import accelkit

        self._networked(place)
        want = self._saved(place)
        assert place.proxy is not None
        key = rf"run/step-1/{RANK0}" if op == "load" else rf"run/step-2/{RANK0}"
        place.proxy.inject(
            Status(503), times=None, **place.request("read" if op == "load" else "write", key)
        )
        if op == "load":
            accel, state = _fresh()
            result = _outcome(lambda: accel.load(place.url("run"), state), state)
            assert not result["ok"]
            _check_load(result, want, must_succeed=False)
            return
        accel, state = _workload(2)
        with pytest.raises(accelkit.CheckpointError):
            accel.save(place.url("run/step-2"), state)
        place.proxy.clear()
        assert place.read("run/latest").decode().strip() == "step-1"
        assert not [k for k in place.keys("run") if k == "run/step-2/accelkit.json"]
        accel, fresh = _fresh()
        accel.load(place.url("run"), fresh)
        assert _digest(fresh) == want

    # ---- two writers, kills, replaced objects ----------------------------------------------------
    @pytest.mark.slow
    @pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
    def test_two_writers_on_one_name(
        self, place: Place, tmp_path: Path, asynchronous: bool
    ) -> None:
        """Two jobs save one name at once, :data:`RACE_RUNS` times: exactly one commits, the
        other fails with "another job writes here", the committed checkpoint is whole (on a
        store that replaces a committed name, a save that began after the other's commit may
        replace it: then the checkpoint is the later committer's, whole; on one that never
        does, that late save fails with "is a committed checkpoint already")."""
        import accelkit

        out = tmp_path / "race"
        out.mkdir()
        urls = [place.url(f"race-{run}/step-1") for run in range(RACE_RUNS)]
        env = place.env()
        jobs = [
            _spawn(
                {
                    "seed": seed,
                    "urls": urls,
                    "out": str(out),
                    "race": True,
                    "asynchronous": asynchronous,
                },
                env,
            )
            for seed in (11, 12)
        ]
        tally: dict[str, int] = {}
        failures = []
        try:
            for run, url in enumerate(urls):
                deadline = time.monotonic() + CHILD_TIMEOUT
                while not all((out / f"ready-{s}-{run}").exists() for s in (11, 12)):
                    assert all(j.poll() is None for j in jobs), _outputs(jobs)
                    assert time.monotonic() < deadline, "a writer never got ready"
                    time.sleep(0.01)
                (out / f"go-{run}").touch()
                results = {}
                while len(results) < 2:
                    for seed in (11, 12):
                        path = out / f"result-{seed}-{run}.json"
                        if seed not in results and path.exists():
                            results[seed] = json.loads(path.read_text())
                    assert time.monotonic() < deadline, f"run {run}: a writer never finished"
                    time.sleep(0.01)
                committed = [s for s, r in results.items() if r["ok"]]
                lost = [r for r in results.values() if not r["ok"]]
                verdict = f"{len(committed)} committed"
                problems = []
                # on a store that replaces a committed name, a save that began only after the
                # other's commit replaced it: both committed, one after the other (checked below:
                # the checkpoint must then be whole and one committer's state)
                one_after_other = len(committed) == 2 and place.replaces_committed
                if len(committed) != 1 and not one_after_other:
                    problems.append(f"{len(committed)} writers were told their save committed")
                late = () if place.replaces_committed else (COMMITTED_ALREADY,)
                for loser in lost:
                    if not any(text in loser["error"] for text in (ANOTHER_JOB, *late)):
                        problems.append(
                            f"the loser's error lacks {ANOTHER_JOB!r}: {loser['type']}: "
                            f"{loser['error'][-300:]}"
                        )
                accel, fresh = _fresh()
                try:
                    accel.load(url, fresh)
                    held = _digest(fresh)
                    if committed and held not in [results[s]["digest"] for s in committed]:
                        problems.append("the checkpoint holds another state than its committer's")
                except accelkit.CheckpointError as err:
                    verdict += ", load failed"
                    problems.append(f"the committed checkpoint does not load: {str(err)[-300:]}")
                tally[verdict] = tally.get(verdict, 0) + 1
                if problems:
                    failures.append(f"run {run}: " + "; ".join(problems))
        finally:
            for job in jobs:
                job.kill()
                job.wait()
        assert not failures, (
            f"{len(failures)} of {RACE_RUNS} runs broke the contract ({tally}):\n"
            + "\n".join(failures)
        )

    @pytest.mark.slow
    def test_killed_between_the_manifest_and_latest(self, place: Place, tmp_path: Path) -> None:
        """SIGKILL after the manifest's write, before ``latest``'s: the checkpoint is
        committed; the next run resumes from it and saves on."""
        out = tmp_path / "kill"
        out.mkdir()
        urls = [place.url("run/step-1"), place.url("run/step-2")]
        job: dict[str, Any] = {"seed": 2, "urls": urls, "steps": [1, 2], "out": str(out)}
        if place.proxy is None:
            job["kill_at_latest"] = 2
            proc = _spawn(job, place.env())
        else:  # hold step-2's latest write at the proxy, then kill the trainer
            # held until the proxy is cleared, then dropped: the server never gets it
            rule = place.proxy.inject(
                Stall(lose=True), nth=2, **place.request("write", "run/latest")
            )
            proc = _spawn(job, place.env())
            deadline = time.monotonic() + CHILD_TIMEOUT
            while not rule.arrived.wait(0.2):
                assert proc.poll() is None, _outputs([proc])
                assert time.monotonic() < deadline, "the save never reached its latest write"
            proc.send_signal(signal.SIGKILL)
        proc.wait(CHILD_TIMEOUT)
        assert proc.returncode == -signal.SIGKILL, _outputs([proc])
        if place.proxy is not None:
            place.proxy.clear()
        assert json.loads((out / "result-2-0.json").read_text())["ok"]
        assert "run/step-2/accelkit.json" in place.keys("run")  # it reached the commit
        accel, state = _fresh()
        accel.load(place.url("run"), state)
        assert state["step"] == 2, f"resumed from step {state['step']}, not from the commit"
        accel, state = _workload(3)
        accel.save(place.url("run/step-3"), state)
        accel, fresh = _fresh()
        accel.load(place.url("run"), fresh)
        assert fresh["step"] == 3

    @pytest.mark.slow
    @pytest.mark.parametrize("nth", [1, 2, 3, 4])
    def test_an_object_replaced_during_a_load_is_refused(self, place: Place, nth: int) -> None:
        """The rank file is replaced (same size and header, every byte of every value flipped)
        when the load's ``nth`` read of it arrives: the load fails clearly or loads the
        original, never a byte of the other."""
        self._networked(place)
        want = self._saved(place, seed=1, big=True)
        key = _rank_key(place, "run/step-1")
        other = _every_value_flipped(place.read(key))
        assert place.proxy is not None
        rule = place.proxy.inject(
            Status(503),  # the replacement happens before this read; the retry reads it
            nth=nth,
            before=lambda _request: place.write(key, other),
            **place.request("read", rf"run/step-1/{RANK0}"),
        )
        accel, state = _fresh(big=True)
        result = _outcome(lambda: accel.load(place.url("run"), state), state)
        if not rule.fired:
            pytest.skip(f"the load made fewer than {nth} reads of the rank file")
        _check_load(result, want, must_succeed=False)

    @pytest.mark.slow
    @pytest.mark.parametrize("when", ["early", "last"])
    def test_an_object_replaced_during_a_two_rank_load_is_refused_on_every_rank(
        self, place: Place, when: str
    ) -> None:
        """As above, with two gloo ranks: at the second read of the rank file (before the ranks
        agree), or at the last (a rank's fill, after they agreed; counted in a clean load
        first)."""
        self._networked(place)
        want = self._saved(place, seed=1, big=True)
        key = _rank_key(place, "run/step-1")
        other = _every_value_flipped(place.read(key))
        assert place.proxy is not None
        rank_file = place.request("read", rf"run/step-1/{RANK0}")
        job = {"url": place.url("run"), "want": want, "big": True}
        env = place.env()
        nth = 2
        if when == "last":
            clean = run_ranks(_RANKS, job, nproc=2, timeout=CHILD_TIMEOUT, env=env)
            _check_ranks(clean, want, must_succeed=True)
            nth = len(place.proxy.requests(**rank_file))
            place.proxy.clear()
        rule = place.proxy.inject(
            Status(503),  # the replacement happens before this read; the retry reads it
            nth=nth,
            before=lambda _request: place.write(key, other),
            **rank_file,
        )
        results = run_ranks(_RANKS, job, nproc=2, timeout=CHILD_TIMEOUT, env=env)
        assert rule.fired == 1, f"the load made fewer than {nth} reads of the rank file"
        _check_ranks(results, want)

    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("fault", "nth", "times"),
        [("reset", 3, 1), ("cut", 3, 1), ("503", 2, 4), ("reset", 3, None)],
        ids=["reset", "cut", "503x4", "reset-forever"],
    )
    def test_two_rank_loads_under_faults_agree(
        self, place: Place, fault: str, nth: int, times: int | None
    ) -> None:
        """Two gloo ranks load under faults of the rank file's reads: both exact, or both fail
        clearly with nothing changed; never a divergence, never a hang."""
        self._networked(place)
        want = self._saved(place, big=True)
        assert place.proxy is not None
        injected = Cut(after=3 << 20) if fault == "cut" else LOAD_FAULTS[fault]
        place.proxy.inject(
            injected,
            nth=nth,
            times=times,
            **place.request("read", rf"run/step-1/{RANK0}"),
        )
        job = {"url": place.url("run"), "want": want, "big": True}
        results = run_ranks(_RANKS, job, nproc=2, timeout=CHILD_TIMEOUT, env=place.env())
        _check_ranks(results, want, must_succeed=times is not None)


def _rank_key(place: Place, checkpoint: str) -> str:
    """The key of rank 0's file of ``checkpoint`` (below the place's prefix)."""
    import re

    found = [k for k in place.keys(checkpoint) if re.fullmatch(rf"{checkpoint}/{RANK0}", k)]
    assert len(found) == 1, f"{checkpoint}: rank 0's file is not one object: {found}"
    return found[0]


def _every_value_flipped(rank_file: bytes) -> bytes:
    """A safetensors file of the same size and header whose every data byte differs."""
    start = 8 + int.from_bytes(rank_file[:8], "little")
    return rank_file[:start] + bytes(b ^ 0xFF for b in rank_file[start:])


def _check_ranks(results: list[dict[str, Any]], want: str, must_succeed: bool = False) -> None:
    outcomes = {r["ok"] for r in results}
    assert len(outcomes) == 1, f"the ranks diverged: {results}"
    for result in results:
        try:
            _check_load(result, want, must_succeed)
        except AssertionError as err:
            raise AssertionError(f"rank {result['rank']}: {err} (every rank: {results})") from None


def _outputs(jobs: list[subprocess.Popen]) -> str:
    texts = []
    for job in jobs:
        if job.poll() is not None and job.stdout is not None:
            texts.append(job.stdout.read()[-3000:])
    return "\n---\n".join(texts) or "(still running)"


def store_contract(store: str, xfail: dict[str, str] | None = None) -> type[StoreContract]:
    """A :class:`StoreContract` subclass for ``store`` (name it ``Test...`` in a test module)."""
    return type(
        f"Test{store.capitalize()}StoreContract",
        (StoreContract,),
        {
            "store": store,
            "xfail": dict(xfail or {}),
            "__module__": sys._getframe(1).f_globals["__name__"],
        },
    )
