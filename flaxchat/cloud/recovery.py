"""Preemption recovery: a pure decision from what the pod looks like, and the loop that acts on it.

`decide(observation, counters, policy)` maps (VM state, queued-resource state, node health, per-worker
process state and training step, completion marker, retry counts, the time of the observation) to
one action and a reason. Nothing in it reads a clock or a network, so a test can walk every branch;
`recover_loop` polls, decides, logs each transition and acts, with the clock and `sleep` injected (a
test runs hours of polling in milliseconds).

    READY, all workers alive and stepping .. WATCH
    completion marker present .............. DONE
    no worker runs this command yet ........ START
    a worker crashed / exited 0 unfinished . RESTART, exponential backoff, bounded
    every stopped worker exited 75 .......... RESTART at once, not counted against max_restarts: the
      (preempted; 143: SIGTERM before the     stage saved its step on the notice (its own budget,
      loop)                                   max_recreates without progress, ends a loop of them)
    a worker exited 2 (a user error) ....... GIVE_UP: running it again fails the same way
    a worker alive, its step unchanged ..... RESTART (hung): the step comes from the progress file
      for heartbeat_deadline_s                every process writes, never from printed lines (only
                                              process 0 prints on a pod); every worker's Python
                                              stacks are written first (worker.py dump: hang-*.txt)
    a worker does not answer ssh ........... WAIT, with backoff, and say so: ssh trouble (a key,
                                              OS Login, IAP, a slow sshd) is no evidence that the VM
                                              is gone, and deleting a READY pod kills a healthy run
      ... and Google says the node is ...... RECREATE (positive evidence: its health field)
      unhealthy, N polls
    PREEMPTED / TERMINATED / missing, or ... RECREATE (delete, create, set up, run: resumes from
      its queued resource FAILED/SUSPENDED    the last complete checkpoint in the bucket), bounded
    CREATING / REPAIRING / RESTARTING ... .. WAIT
    STOPPED (someone stopped it) ........... GIVE_UP: never delete what the user stopped

The retry budgets count interventions *without progress*: once the training step moves past where
it was at the last restart, the counts start again, so a month-long spot run survives many
preemptions while a command that crashes at once gives up after `max_restarts`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Protocol, Sequence

from flaxchat.errors import ExitCode
from flaxchat.runner.base import RemoteError

GONE_STATES = frozenset({"PREEMPTED", "TERMINATED"})
QR_GONE_STATES = frozenset({"FAILED", "SUSPENDED", "SUSPENDING"})
# Google's node `health` values that say the host itself is broken (not just our ssh to it).
BAD_HEALTH = frozenset({"UNHEALTHY_MAINTENANCE", "TIMEOUT", "UNHEALTHY_TENSORFLOW"})
# What a stage that was preempted exits with (flaxchat.errors.ExitCode, docs/deployment.md): 75 when
# it saved its step on the notice; 143 (128 + SIGTERM, as the worker reports a signal) when the
# notice came before its loop, where nothing had been trained since its checkpoint.
PREEMPTED_EXITS = frozenset({int(ExitCode.PREEMPTED), 128 + 15})
WAIT_STATES = frozenset({"CREATING", "REPAIRING", "RESTARTING", "STARTING", "STOPPING", "DELETING", "UNKNOWN",
                         "STATE_UNSPECIFIED"})


class Action(str, enum.Enum):
    WATCH = "watch"
    DONE = "done"
    START = "start"
    RESTART = "restart"
    RECREATE = "recreate"
    WAIT = "wait"
    GIVE_UP = "give-up"


@dataclasses.dataclass(frozen=True)
class WorkerObs:
    """One worker as `worker.py status` reported it (or did not: reachable=False)."""

    reachable: bool = True
    state: str = "running"  # none | starting | running | exiting | exited | killed
    exit_code: int | None = None
    progress_age: float | None = None  # s since its last finished step, by the VM's clock (display only)
    step: int | None = None  # its last finished step, from its progress file
    run_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Observation:
    vm_state: str | None  # None: the VM does not exist
    workers: Sequence[WorkerObs] = ()
    complete: bool = False  # the training's own completion marker exists
    run_id: str | None = None  # the run we are recovering; workers on another run have not started it
    expects_marker: bool = True  # False for a command without a completion marker: all exit 0 = done
    health: str | None = None  # the node's `health` field (HEALTHY, TIMEOUT, UNHEALTHY_MAINTENANCE...)
    qr_state: str | None = None  # the queued resource's state, for a spot VM
    now: float = 0.0  # when this was observed, by the recovery's (injected) clock


@dataclasses.dataclass(frozen=True)
class Counters:
    restarts: int = 0  # since the last progress
    recreates: int = 0  # since the last progress
    preemptions: int = 0  # restarts after an exit 75, since the last progress (not against max_restarts)
    unreachable_polls: int = 0  # consecutive polls with a worker that did not answer
    progress_step: int | None = None  # the furthest step seen
    # Per worker: (run id, last step seen, when that step was first seen): a worker whose step has
    # not moved for heartbeat_deadline_s of the recovery's clock is hung. Measured here, not on the
    # VM, so a skewed VM clock does not matter and an injected clock drives it in tests.
    steps_seen: tuple = ()


@dataclasses.dataclass(frozen=True)
class Policy:
    poll_s: float = 60.0
    max_restarts: int = 5
    max_recreates: int = 10
    backoff_s: float = 30.0
    max_backoff_s: float = 600.0
    heartbeat_deadline_s: float = 1800.0  # no new step this long while alive = hung (compiles take minutes)
    unreachable_polls: int = 3  # with Google saying the node is unhealthy: recreate after this many
    max_ssh_backoff_s: float = 600.0  # ssh trouble: the wait between polls doubles up to this
    max_observe_failures: int = 10  # consecutive polls that could not even look (gcloud errors)


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    delay: float = 0.0  # seconds to wait before acting (restart backoff)
    counted: bool = True  # a RESTART that counts against max_restarts (a preemption's does not)
    hung: bool = False  # a RESTART of a hung run: its stacks are written before it is killed


def _backoff(policy: Policy, restarts: int) -> float:
    return min(policy.max_backoff_s, policy.backoff_s * (2 ** restarts))


def decide(obs: Observation, counters: Counters, policy: Policy) -> Decision:
    """The next action for the pod; pure."""
    state = obs.vm_state
    if state is None or state in GONE_STATES or obs.qr_state in QR_GONE_STATES:
        why = ("the VM no longer exists" if state is None else f"the VM is {state}" if state in GONE_STATES
               else f"its queued resource is {obs.qr_state}")
        if counters.recreates >= policy.max_recreates:
            return Decision(Action.GIVE_UP, f"{why}, and it was recreated {counters.recreates} times without progress")
        return Decision(Action.RECREATE, f"{why}: delete, recreate, set up and run the command again (it "
                                           "resumes from the run folder's newest committed step, or says that it "
                                           "starts at step 0 when none was committed)")
    if state in WAIT_STATES:
        return Decision(Action.WAIT, f"the VM is {state}")
    if state != "READY":
        return Decision(Action.GIVE_UP, f"the VM is {state}; start it (or --teardown) yourself, recovery "
                                        "never deletes a VM that was stopped on purpose")
    if obs.complete:
        return Decision(Action.DONE, "the completion marker is there: training finished")
    return _decide_ready(obs, counters, policy)


def _decide_ready(obs: Observation, counters: Counters, policy: Policy) -> Decision:
    silent = [i for i, w in enumerate(obs.workers) if not w.reachable]
    if silent:
        polls = counters.unreachable_polls + 1
        if obs.health in BAD_HEALTH and polls >= policy.unreachable_polls:
            if counters.recreates >= policy.max_recreates:
                return Decision(Action.GIVE_UP, f"worker(s) {silent} stopped answering and recreating did not help")
            return Decision(Action.RECREATE, f"worker(s) {silent} did not answer for {polls} polls and Google "
                                             f"reports the node's health as {obs.health}")
        delay = min(policy.max_ssh_backoff_s, policy.poll_s * 2 ** min(polls - 1, 10))
        # A VM being preempted still reads READY for a poll or so while its workers are already gone:
        # only a silence that lasts is worth pointing at the user's ssh set-up.
        hint = ("; if this goes on, check your ssh key, OS Login or firewall" if polls >= policy.unreachable_polls
                else " (a VM going down, as in a preemption, answers so before its state says it)")
        return Decision(Action.WAIT, f"ssh to worker(s) {silent} failed ({polls} poll(s) in a row) while the VM is "
                                     f"READY: waiting, a READY VM is never deleted for ssh trouble{hint}", delay)
    def foreign(w):  # not running our command at all (never started it, or an older run)
        return w.state == "none" or (obs.run_id is not None and w.run_id != obs.run_id)
    if all(foreign(w) for w in obs.workers):
        if counters.restarts >= policy.max_restarts:  # failed starts count (recover_loop): a bad command
            return Decision(Action.GIVE_UP, f"the command could not be started {counters.restarts} times in a row")
        return Decision(Action.START, "the command is not running on the workers yet")
    crashed = [(i, w) for i, w in enumerate(obs.workers)
               if foreign(w) or w.state == "killed" or (w.state == "exited" and w.exit_code != 0)]
    finished = all(w.state == "exited" and w.exit_code == 0 for w in obs.workers)
    hung = [i for i, w in enumerate(obs.workers) if w.state in ("running", "starting")
            and obs.now - _since(counters, i, w, obs.now) > policy.heartbeat_deadline_s]
    if crashed:
        what = ", ".join(f"worker {i} " + ("never started" if foreign(w) else "was killed" if w.state == "killed"
                                           else f"exited {w.exit_code}") for i, w in crashed)
        if any(w.state == "exited" and w.exit_code == ExitCode.USER_ERROR for _, w in crashed):
            return Decision(Action.GIVE_UP, f"{what}: exit 2 is a user error (its last line says which), and "
                                            "running the same command again fails the same way")
        if all(w.state == "exited" and w.exit_code in PREEMPTED_EXITS for _, w in crashed):
            if counters.preemptions >= policy.max_recreates:
                return Decision(Action.GIVE_UP, f"{what}: preempted {counters.preemptions} times without progress")
            return Decision(Action.RESTART, f"{what} (preempted, its step saved): resume now, not counted against "
                                            "--max-restarts", counted=False)
        return _restart(what, counters, policy)
    if finished:
        if not obs.expects_marker:
            return Decision(Action.DONE, "every worker exited 0")
        return _restart("every worker exited 0 but the completion marker is missing", counters, policy)
    if hung:
        d = _restart(f"worker(s) {hung} alive but no training step for over {policy.heartbeat_deadline_s:.0f} s "
                     "(hung)", counters, policy)
        return dataclasses.replace(d, hung=d.action is Action.RESTART)
    return Decision(Action.WATCH, "the VM is READY and the workers are running")


def _since(counters: Counters, i: int, w: WorkerObs, now: float) -> float:
    """When worker i's current step was first seen (now, if this is the first look at it)."""
    seen = dict(enumerate(counters.steps_seen)).get(i)
    if seen and seen[0] == w.run_id and seen[1] == w.step:
        return seen[2]
    return now


def _restart(what: str, counters: Counters, policy: Policy) -> Decision:
    if counters.restarts >= policy.max_restarts:
        return Decision(Action.GIVE_UP, f"{what}; restarted {counters.restarts} times without progress")
    delay = _backoff(policy, counters.restarts)
    return Decision(Action.RESTART, f"{what}: restart {counters.restarts + 1} of {policy.max_restarts} "
                                    f"in {delay:.0f} s", delay)


def next_counters(counters: Counters, obs: Observation, decision: Decision) -> Counters:
    """Counters after acting on `decision`; pure. Progress past the last mark resets the budgets."""
    steps = [w.step for w in obs.workers if w.step is not None]
    best = max(steps) if steps else None
    c = counters
    if best is not None and (c.progress_step is None or best > c.progress_step):
        c = dataclasses.replace(c, restarts=0, recreates=0, preemptions=0, progress_step=best)
    unreachable = any(not w.reachable for w in obs.workers) and obs.vm_state == "READY"
    c = dataclasses.replace(c, unreachable_polls=c.unreachable_polls + 1 if unreachable else 0)
    if obs.workers and not unreachable:
        c = dataclasses.replace(c, steps_seen=tuple((w.run_id, w.step, _since(counters, i, w, obs.now))
                                                    for i, w in enumerate(obs.workers)))
    if decision.action is Action.RESTART and decision.counted:
        c = dataclasses.replace(c, restarts=c.restarts + 1)
    elif decision.action is Action.RESTART:
        c = dataclasses.replace(c, preemptions=c.preemptions + 1)
    elif decision.action is Action.RECREATE:
        c = dataclasses.replace(c, recreates=c.recreates + 1, unreachable_polls=0)
    if decision.action in (Action.RESTART, Action.RECREATE, Action.START):
        c = dataclasses.replace(c, steps_seen=())  # a new run: its clock starts at the next look
    return c


class Actions(Protocol):
    def dump_stacks(self) -> None: ...  # every worker's Python stacks into hang-<time>.txt
    def start(self) -> None: ...
    def restart(self) -> None: ...
    def recreate(self) -> None: ...


def recover_loop(observe: Callable[[], Observation], actions: Actions, policy: Policy = Policy(), *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 log: Callable[[str], None] = print, timeout: float | None = None) -> Decision:
    """Poll, decide, act until DONE or GIVE_UP (returned). Each change of action is logged with its reason.

    A failed action (say, no spot capacity for the recreate) is logged and retried on the next poll;
    its attempt still counts against the budget.
    """
    t0 = clock()
    counters, last, failures = Counters(), None, 0
    while True:
        try:
            obs = observe()
            failures = 0
        except RemoteError as e:  # a transient gcloud/network error must not end a week-long watch
            failures += 1
            log(f"[recover +{clock() - t0:.0f}s] could not look at the VM ({failures}/{policy.max_observe_failures}): {e}")
            if failures >= policy.max_observe_failures:
                return Decision(Action.GIVE_UP, f"the VM could not be observed {failures} times in a row: {e}")
            sleep(policy.poll_s)
            continue
        decision = decide(obs, counters, policy)
        if timeout is not None and clock() - t0 > timeout and decision.action not in (Action.DONE, Action.GIVE_UP):
            decision = Decision(Action.GIVE_UP, f"recovery timed out after {timeout:.0f} s")
        if last is None or (decision.action, decision.reason) != (last.action, last.reason):
            log(f"[recover +{clock() - t0:.0f}s] {decision.action.value}: {decision.reason}")
        last = decision
        counters = next_counters(counters, obs, decision)
        if decision.action in (Action.DONE, Action.GIVE_UP):
            return decision
        try:
            if decision.action is Action.RESTART:
                if decision.hung:  # before the kill: where it was stuck
                    actions.dump_stacks()
                sleep(decision.delay)
                actions.restart()
            elif decision.action is Action.RECREATE:
                actions.recreate()
            elif decision.action is Action.START:
                actions.start()
        except RemoteError as e:
            log(f"[recover +{clock() - t0:.0f}s] {decision.action.value} failed: {e}")
            if decision.action is Action.START:  # a command that exits at once was started for ever
                counters = dataclasses.replace(counters, restarts=counters.restarts + 1)
        sleep(decision.delay if decision.action is Action.WAIT and decision.delay else policy.poll_s)


# --- the health report (what --health prints) --------------------------------------------------------


def _age(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def format_health(report: dict) -> str:
    """The health report as a table, one row per worker, then one line per problem."""
    lines = [f"TPU VM {report['vm']} ({report['accelerator']}, {report['zone']}): {report['state']}"]
    if report["workers"]:
        lines.append(f"{'worker':<7}{'process':<10}{'exit':<6}{'step':<13}{'loss':<9}{'tok/s':<11}"
                     f"{'progress':<11}{'disk':<7}last line")
    for w in report["workers"]:
        if not w.get("reachable", True):
            lines.append(f"{w['worker']:<7}unreachable")
            continue
        step = f"{w['step']}/{w['steps'] or '?'}" if w.get("step") is not None else "-"
        loss = f"{w['loss']:.4f}" if w.get("loss") is not None else "-"
        toks = f"{w['tok_s']:,.0f}" if w.get("tok_s") is not None else "-"
        code = "-" if w.get("exit_code") is None else str(w["exit_code"])
        lines.append(f"{w['worker']:<7}{w['state']:<10}{code:<6}{step:<13}{loss:<9}{toks:<11}"
                     f"{_age(w.get('progress_age')):<11}{str(w.get('disk_used_pct', '-')) + '%':<7}"
                     f"{(w.get('last_line') or '')[:80]}")
    lines += [f"problem: {p}" for p in report["problems"]]
    # Not a problem of the run going now (a restart followed), but where the last hang was stuck.
    lines += [f"stacks of worker {w['worker']}'s last hang: {w['hang_file']} (on the worker)"
              for w in report["workers"] if w.get("hang_file")]
    return "\n".join(lines)


def health_problems(state: str, workers: list[dict], deadline_s: float) -> list[str]:
    problems = [] if state == "READY" else [f"the VM is {state}"]
    for w in workers:
        i = w["worker"]
        if not w.get("reachable", True):
            problems.append(f"worker {i} does not answer ssh")
        elif w["state"] == "exited" and w["exit_code"] in PREEMPTED_EXITS:
            problems.append(f"worker {i} was preempted (exit {w['exit_code']}): its step was saved; resume it")
        elif w["state"] == "exited" and w["exit_code"] != 0:
            problems.append(f"worker {i} crashed (exit {w['exit_code']}): {w.get('last_line', '')}")
        elif w["state"] == "killed":
            problems.append(f"worker {i}'s process was killed (no exit code): {w.get('last_line', '')}")
        elif w["state"] == "running" and (w.get("progress_age") or 0) > deadline_s:
            problems.append(f"worker {i} has finished no training step for {_age(w['progress_age'])} (hung?)")
    return problems
