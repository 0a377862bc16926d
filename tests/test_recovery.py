"""The preemption state machine: every branch of the pure decision, then the loop on a fake clock."""

import pytest

from flaxchat.cloud.recovery import (Action, Counters, Decision, Observation, Policy, WorkerObs, decide,
                                     next_counters, recover_loop)
from flaxchat.runner.base import RemoteError

P = Policy(poll_s=60, max_restarts=3, max_recreates=2, backoff_s=10, max_backoff_s=25,
           heartbeat_deadline_s=600, unreachable_polls=3)
RUN = "r1"


def alive(step=5, age=1.0):
    return WorkerObs(state="running", progress_age=age, step=step, run_id=RUN)


def exited(code, step=5):
    return WorkerObs(state="exited", exit_code=code, step=step, run_id=RUN)


def obs(*workers, vm="READY", complete=False, expects_marker=True, run_id=RUN, now=0.0, health="HEALTHY",
        qr=None):
    return Observation(vm, workers, complete, run_id, expects_marker, health=health, qr_state=qr, now=now)


def act(o, c=Counters()):
    return decide(o, c, P)


def test_ready_and_all_alive_keeps_watching():
    assert act(obs(alive(), alive())).action is Action.WATCH


def test_completion_marker_means_done_even_while_workers_exit():
    d = act(obs(exited(0), alive(), complete=True))
    assert d.action is Action.DONE and "marker" in d.reason


@pytest.mark.parametrize("state", ["PREEMPTED", "TERMINATED", None])
def test_gone_vm_is_recreated(state):
    d = act(obs(vm=state))
    assert d.action is Action.RECREATE
    assert (state or "no longer exists") in d.reason


def test_recreates_are_bounded():
    d = act(obs(vm="PREEMPTED"), Counters(recreates=2))
    assert d.action is Action.GIVE_UP and "2 times" in d.reason


@pytest.mark.parametrize("state", ["CREATING", "REPAIRING", "RESTARTING", "STARTING"])
def test_transitional_states_wait(state):
    assert act(obs(vm=state)).action is Action.WAIT


def test_stopped_vm_is_never_deleted():
    d = act(obs(vm="STOPPED"))
    assert d.action is Action.GIVE_UP and "never deletes" in d.reason


def test_not_started_yet_starts_without_counting_a_restart():
    d = act(obs(WorkerObs(state="none", run_id=None), WorkerObs(state="none", run_id=None)))
    assert d.action is Action.START
    assert next_counters(Counters(), obs(), d).restarts == 0


def test_workers_on_an_older_run_count_as_not_started():
    old = WorkerObs(state="exited", exit_code=0, run_id="old")
    assert act(obs(old, old)).action is Action.START


def test_crash_on_one_worker_restarts_with_exponential_backoff():
    o = obs(alive(), exited(1))
    d0 = act(o)
    assert d0.action is Action.RESTART and "worker 1 exited 1" in d0.reason and d0.delay == 10
    assert act(o, Counters(restarts=1)).delay == 20
    assert act(o, Counters(restarts=2)).delay == 25  # capped
    assert act(o, Counters(restarts=3)).action is Action.GIVE_UP


def test_killed_worker_restarts():
    d = act(obs(alive(), WorkerObs(state="killed", run_id=RUN)))
    assert d.action is Action.RESTART and "worker 1 was killed" in d.reason


def test_a_worker_that_never_joined_this_run_is_a_crash():
    d = act(obs(alive(), WorkerObs(state="none", run_id=None)))
    assert d.action is Action.RESTART and "never started" in d.reason


def test_all_exit_zero_without_marker_restarts_but_done_without_a_marker_to_expect():
    assert act(obs(exited(0), exited(0))).action is Action.RESTART
    assert act(obs(exited(0), exited(0), expects_marker=False)).action is Action.DONE


def test_some_finished_others_running_keeps_watching():
    assert act(obs(exited(0), alive())).action is Action.WATCH


def test_a_step_that_stops_moving_past_the_deadline_is_hung():
    """Liveness is the step (from each process's progress file) moving on the recovery's clock."""
    c = next_counters(Counters(), obs(alive(5), alive(5), now=0.0), Decision(Action.WATCH, ""))
    c = next_counters(c, obs(alive(9), alive(5), now=300.0), Decision(Action.WATCH, ""))
    assert act(obs(alive(12), alive(5), now=599.0), c).action is Action.WATCH
    d = act(obs(alive(14), alive(5), now=601.0), c)
    assert d.action is Action.RESTART and "hung" in d.reason and "[1]" in d.reason and d.hung
    # The worker's own clock (progress_age) does not decide: a skewed VM clock is harmless.
    assert act(obs(alive(14, age=10_000), alive(6, age=10_000), now=601.0), c).action is Action.WATCH


def test_two_simulated_hours_where_only_process_0_prints_then_one_hang_is_one_restart():
    """The seed restarted a healthy pod every 30 min: its heartbeat was process 0's printed lines."""
    clock, logs, state = FakeClock(), [], {"run": "r1", "frozen_at": None, "restarts": 0}

    def observe():
        t = clock.t
        step = int(t // 60)
        w1 = step if state["frozen_at"] is None or state["run"] != "r1" else state["frozen_at"]
        if t >= 2 * 3600 and state["frozen_at"] is None:
            state["frozen_at"] = w1 = step
        done = state["run"] == "r2" and t >= 5 * 3600
        # Worker 1 never prints (no last line), only its progress file moves.
        return obs(WorkerObs(state="running", step=step, run_id=state["run"]),
                   WorkerObs(state="running", step=w1, run_id=state["run"]), run_id=state["run"], now=t,
                   complete=done)

    class Pod:
        def start(self):
            raise AssertionError("already running")

        def dump_stacks(self):  # the hung run is still there when its stacks are asked for
            assert state["run"] == "r1"
            state["dumps"] = state.get("dumps", 0) + 1

        def restart(self):
            state["restarts"] += 1
            state["run"] = "r2"

        def recreate(self):
            raise AssertionError("nothing to recreate")
    policy = Policy(poll_s=60, heartbeat_deadline_s=1800, backoff_s=30)
    d = recover_loop(observe, Pod(), policy, clock=clock, sleep=clock.sleep, log=logs.append)
    assert d.action is Action.DONE and state["restarts"] == 1 and state["dumps"] == 1, logs
    restart = [x for x in logs if "restart:" in x]
    assert len(restart) == 1 and "worker(s) [1] alive but no training step for over 1800 s" in restart[0]
    assert float(restart[0].split("+")[1].split("s]")[0]) >= 2 * 3600 + 1800  # not before 2 h + the deadline


def test_ssh_trouble_on_a_ready_vm_waits_with_backoff_and_never_recreates():
    o = obs(alive(), WorkerObs(reachable=False))
    delays = []
    c = Counters()
    for _ in range(8):
        d = decide(o, c, P)
        assert d.action is Action.WAIT and "never deleted for ssh trouble" in d.reason
        delays.append(d.delay)
        c = next_counters(c, o, d)
    assert delays[:3] == [60, 120, 240] and max(delays) == P.max_ssh_backoff_s


def test_unreachable_and_google_says_unhealthy_recreates():
    o = obs(alive(), WorkerObs(reachable=False), health="UNHEALTHY_MAINTENANCE")
    assert act(o, Counters(unreachable_polls=1)).action is Action.WAIT
    d = act(o, Counters(unreachable_polls=2))
    assert d.action is Action.RECREATE and "UNHEALTHY_MAINTENANCE" in d.reason


@pytest.mark.parametrize("qr", ["FAILED", "SUSPENDED"])
def test_a_queued_resource_gone_bad_is_recreated(qr):
    d = act(obs(alive(), alive(), qr=qr))
    assert d.action is Action.RECREATE and f"queued resource is {qr}" in d.reason


def test_counters_track_restarts_and_unreachable_streaks():
    o = obs(alive(step=3), exited(1, step=3))
    c = next_counters(Counters(), o, Decision(Action.RESTART, ""))
    assert (c.restarts, c.progress_step) == (1, 3)
    c = next_counters(c, o, Decision(Action.RESTART, ""))
    assert c.restarts == 2  # no progress since: the budget keeps shrinking
    c = next_counters(c, obs(alive(step=4), alive(step=4)), Decision(Action.WATCH, ""))
    assert (c.restarts, c.recreates, c.progress_step) == (0, 0, 4)  # progress resets it
    u = obs(alive(), WorkerObs(reachable=False))
    c = next_counters(next_counters(c, u, Decision(Action.WAIT, "")), u, Decision(Action.WAIT, ""))
    assert c.unreachable_polls == 2
    assert next_counters(c, u, Decision(Action.RECREATE, "")).unreachable_polls == 0
    assert next_counters(c, obs(alive(), alive()), Decision(Action.WATCH, "")).unreachable_polls == 0


class FakePod:
    """Scripted observations; the actions record themselves (and may fail)."""

    def __init__(self, script, fail=(), fail_always=()):
        self.script, self.fail, self.calls = list(script), set(fail), []
        self.fail_always = set(fail_always)

    def observe(self):
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def _act(self, name):
        self.calls.append(name)
        if name in self.fail or name in self.fail_always:
            self.fail.discard(name)
            raise RemoteError(f"{name} failed: RESOURCE_EXHAUSTED")

    def start(self):
        self._act("start")

    def restart(self):
        self._act("restart")

    def dump_stacks(self):
        self._act("dump_stacks")

    def recreate(self):
        self._act("recreate")


class FakeClock:
    def __init__(self):
        self.t, self.sleeps = 0.0, []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.sleeps.append(s)
        self.t += s


def test_loop_walks_start_preemption_crash_and_completion():
    none = WorkerObs(state="none", run_id=None)
    pod = FakePod([obs(none, none), obs(alive(1), alive(1)), obs(vm="PREEMPTED"), obs(vm="CREATING"),
                   obs(alive(2), exited(1, 2)), obs(alive(3), alive(3)), obs(exited(0), exited(0), complete=True)])
    clock, logs = FakeClock(), []
    d = recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=logs.append)
    assert d.action is Action.DONE
    assert pod.calls == ["start", "recreate", "restart"]
    assert clock.sleeps.count(60) == 6 and 10 in clock.sleeps  # polls, and the restart backoff
    text = "\n".join(logs)
    for word in ("start:", "watch:", "recreate: the VM is PREEMPTED", "wait: the VM is CREATING",
                 "restart: worker 1 exited 1", "done:"):
        assert word in text
    assert logs[0].startswith("[recover +0s]")


def test_loop_logs_a_failed_action_and_retries_it():
    pod = FakePod([obs(vm="PREEMPTED"), obs(vm="PREEMPTED"), obs(alive(), alive(), complete=True)], fail={"recreate"})
    clock, logs = FakeClock(), []
    assert recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=logs.append).action is Action.DONE
    assert pod.calls == ["recreate", "recreate"]
    assert any("recreate failed: recreate failed: RESOURCE_EXHAUSTED" in line for line in logs)


def test_loop_gives_up_after_bounded_restarts():
    pod = FakePod([obs(alive(), exited(1))])
    clock = FakeClock()
    d = recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=lambda s: None)
    assert d.action is Action.GIVE_UP and "restarted 3 times" in d.reason
    assert pod.calls == ["restart"] * 3


def test_a_user_error_is_not_retried():
    pod = FakePod([obs(alive(), exited(2))])
    clock = FakeClock()
    d = recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=lambda s: None)
    assert d.action is Action.GIVE_UP and "worker 1 exited 2" in d.reason and "user error" in d.reason
    assert pod.calls == []


@pytest.mark.parametrize("code", [75, 143])  # saved on the notice; SIGTERM before the loop
def test_a_preemption_resumes_at_once_without_counting_against_max_restarts(code):
    c = Counters(restarts=P.max_restarts, progress_step=5)  # the crash budget is spent: a preemption still resumes
    d = act(obs(exited(code), exited(code)), c)
    assert d.action is Action.RESTART and d.delay == 0 and not d.counted and "preempted" in d.reason
    after = next_counters(c, obs(exited(code), exited(code)), d)
    assert (after.restarts, after.preemptions) == (P.max_restarts, 1)
    # Mixed with a crash, it is a crash.
    assert act(obs(exited(code), exited(1)), Counters()).counted


def test_preemptions_with_progress_go_on_for_ever_and_without_it_give_up():
    steps = iter(range(10, 1000, 10))
    pod = FakePod([obs(exited(75, s), exited(75, s)) for s in [next(steps) for _ in range(20)]]
                  + [obs(exited(75, 500), exited(75, 500))])  # the last one repeats: no progress
    clock = FakeClock()
    d = recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=lambda s: None)
    assert d.action is Action.GIVE_UP and f"preempted {P.max_recreates} times without progress" in d.reason
    assert pod.calls == ["restart"] * (20 + P.max_recreates)  # 20 with progress, then the bounded ones


def test_loop_gives_up_on_a_command_that_exits_at_once_every_time_it_is_started():
    # Seen in the launcher rehearsal: `--recover "gcloud storage cp ... && python -m scripts.sft ..."`
    # whose first part failed at once was started again every 11 s for ever.
    none = WorkerObs(state="none", run_id=None)
    pod = FakePod([obs(none, none, run_id=None)], fail_always={"start"})
    clock, logs = FakeClock(), []
    d = recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=logs.append)
    assert d.action is Action.GIVE_UP and "could not be started 3 times" in d.reason
    assert pod.calls == ["start"] * 3 and sum("start failed" in line for line in logs) == 3


def test_loop_timeout_is_a_give_up():
    pod = FakePod([obs(alive(), alive())])
    clock = FakeClock()
    d = recover_loop(pod.observe, pod, P, clock=clock, sleep=clock.sleep, log=lambda s: None, timeout=300)
    assert d.action is Action.GIVE_UP and "timed out" in d.reason and clock.t <= 400


def test_loop_survives_transient_observe_errors_but_not_endless_ones():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RemoteError("gcloud said: UNAVAILABLE")
        return obs(alive(), alive(), complete=True)
    clock, logs = FakeClock(), []
    assert recover_loop(flaky, FakePod([obs()]), P, clock=clock, sleep=clock.sleep, log=logs.append).action is Action.DONE
    assert sum("could not look at the VM" in line for line in logs) == 2

    def broken():
        raise RemoteError("gcloud said: PERMISSION_DENIED")
    d = recover_loop(broken, FakePod([obs()]), P, clock=clock, sleep=clock.sleep, log=lambda s: None)
    assert d.action is Action.GIVE_UP and "PERMISSION_DENIED" in d.reason


def test_health_names_a_worker_without_progress_and_one_that_does_not_answer():
    from flaxchat.cloud.recovery import health_problems
    workers = [{"worker": 0, "state": "running", "progress_age": 12.0},
               {"worker": 1, "state": "running", "progress_age": 2100.0},
               {"worker": 2, "reachable": False}]
    assert health_problems("READY", workers, 1800.0) == [
        "worker 1 has finished no training step for 35m (hung?)", "worker 2 does not answer ssh"]


def test_health_calls_a_preemption_by_its_name_and_names_the_last_hangs_stacks():
    from flaxchat.cloud.recovery import format_health, health_problems
    workers = [{"worker": 0, "state": "exited", "exit_code": 75, "hang_file": "/h/.flaxchat/run/hang-1.txt"},
               {"worker": 1, "state": "exited", "exit_code": 1, "last_line": "Traceback"}]
    problems = health_problems("READY", workers, 1800.0)
    assert problems == ["worker 0 was preempted (exit 75): its step was saved; resume it",
                        "worker 1 crashed (exit 1): Traceback"]
    text = format_health({"vm": "v", "accelerator": "v4-8", "zone": "z", "state": "READY", "workers": workers,
                          "problems": problems})
    assert "stacks of worker 0's last hang: /h/.flaxchat/run/hang-1.txt (on the worker)" in text
