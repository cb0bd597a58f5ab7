"""CUDA stream discipline of the collective worker, checked on CPU against a recording fake.

On a GPU, each group's worker runs its jobs on its own stream
(:mod:`gradcomp.streams`). Here ``torch.cuda``'s stream and event API is
replaced by a fake that records, per thread, which stream is current, and
every aten and c10d op, ``Work.wait`` and stream-to-event wait is logged with
the stream it would be enqueued on. The CPU tensors then take the same path
CUDA tensors take.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp import collectives, streams
from gradcomp.ddp import timing as hook_timing
from tests.fake_cuda import WORKER, FakeCuda, FakeEvent, FakeStream, Recorder, install_fake
from tests.utils import run_ranks


def check_worker_discipline(fake: FakeCuda, jobs: int) -> FakeStream:
    """Every op, collective and wait of the worker ran on its one stream, which
    waited on the submitter's events first; the submitter's stream waited on
    nothing of gradcomp's. Returns the worker's stream."""
    worker_ops = [entry for entry in fake.log if entry[0] in ("op", "work wait") and entry[2] == WORKER]
    assert worker_ops, "the worker ran nothing"
    worker_streams = {entry[1] for entry in worker_ops}
    assert len(worker_streams) == 1 and fake.default not in worker_streams, worker_streams
    (worker,) = worker_streams
    assert any("c10d" in entry[3] for entry in worker_ops if entry[0] == "op"), "no collective seen"
    submits = [entry[2] for entry in fake.log if entry[0] == "record" and entry[1] is fake.default]
    waits = [entry for entry in fake.log if entry[0] == "wait event" and entry[1] is worker]
    assert len(waits) == jobs and {entry[2] for entry in waits} <= set(submits), (waits, submits)
    assert any(entry[:2] == ("record_stream", worker) for entry in fake.log)
    completions = [entry for entry in fake.log if entry[0] == "complete"]
    assert len(completions) >= jobs and all(entry[1] is worker for entry in completions)
    assert all(devices for kind, *devices in fake.log if kind == "future")
    return worker


def _hook_runs_on_the_worker_stream(rank: int, world_size: int) -> None:
    from tests.ddp.models import DDP, make_model, train

    model = DDP(make_model(), bucket_cap_mb=0.02)
    state, returned = gradcomp.ddp.HookState("int8", min_numel=0), []

    def hook(state, bucket):  # keeps the futures gradcomp gives DDP, which waits on them in C++
        returned.append(gradcomp.ddp.hook(state, bucket))
        return returned[-1]

    model.register_comm_hook(state, hook)
    train(model, rank, world_size, 2)  # DDP's bucket rebuild
    collectives.release_queues()  # the next worker starts under the fake
    fake = install_fake()
    train(model, rank, world_size, 1)  # agreement checks
    returned.clear()
    fake.log.clear()
    with Recorder(fake):
        train(model, rank, world_size, 1)
        waited_from = len(fake.log)
        for future in returned:
            future.wait()  # as DDP's reducer does: the backward's stream takes the buckets
    fake.restore()
    buckets = state.last_stats.buckets
    check_worker_discipline(fake, jobs=buckets)
    caller_waits = [e for e in fake.log[:waited_from] if e[0] == "wait event" and e[1] is fake.default]
    assert not caller_waits, "gradcomp made the backward stream wait"
    assert len(returned) == buckets and not unordered_results(fake)


@pytest.mark.slow
def test_ddp_hook_runs_every_kernel_and_wait_on_the_workers_stream():
    run_ranks(_hook_runs_on_the_worker_stream, 2)


def ordered_before(fake: FakeCuda) -> list[dict]:
    """For each log entry, what the stream it happened on is ordered after: per stream,
    the log index of the last op of that stream that must run before (a vector clock:
    an op advances its stream's own entry, a recorded event takes the stream's clock,
    a stream waiting on an event takes the event's)."""
    clocks: dict[FakeStream, dict] = {}
    at_record: dict[FakeEvent, dict] = {}
    seen = []
    for index, entry in enumerate(fake.log):
        kind, stream = entry[0], entry[1] if len(entry) > 1 else None
        clock = clocks.setdefault(stream, {}) if isinstance(stream, FakeStream) else {}
        if kind == "op":
            clock[stream] = index
        elif kind == "record":
            at_record[entry[2]] = dict(clock)
        elif kind == "wait event":
            for other, last in at_record.get(entry[2], {}).items():
                clock[other] = max(clock.get(other, -1), last)
        seen.append(dict(clock))
    return seen


def unordered_results(fake: FakeCuda) -> list[str]:
    """Every job result a caller took (a ``wait()`` on a job's future) before its stream
    was ordered after all the work the worker's stream had queued when it completed."""
    clocks = ordered_before(fake)
    completed = {entry[3]: index for index, entry in enumerate(fake.log) if entry[0] == "complete"}
    problems = []
    for index, entry in enumerate(fake.log):
        job = entry[3] if entry[0] == "waited" else None
        while job is not None and getattr(job, "parent", None) is not None:
            job = job.parent  # a then() child: ordered after its job's work, through it
        if job not in completed:
            continue
        done = completed[job]
        worker_ops = [i for i, e in enumerate(fake.log[:done]) if e[0] == "op" and e[2] == WORKER]
        last = max(worker_ops, default=-1)
        worker = fake.log[last][1] if worker_ops else None
        if worker is not None and clocks[index].get(worker, -1) < last:
            problems.append(f"log {index}: {entry[1]} took a result before {worker}'s op {fake.log[last][3]}")
    return problems


def _results_are_ordered_on_the_callers_stream(rank: int, world_size: int) -> None:
    from gradcomp import planner
    from gradcomp.collectives import cost_model

    tensor = torch.randn(5000)
    fake = install_fake()
    gradcomp.all_reduce(tensor.clone(), "int8")  # agreement check
    fake.log.clear()
    with Recorder(fake):
        work = gradcomp.all_reduce(tensor, "int8", async_op=True)
        submitted = len(fake.log)
        work.wait()
    worker = check_worker_discipline(fake, jobs=1)
    # Between submit and wait the caller issued nothing; its wait is on the worker's completion event.
    caller = [entry for entry in fake.log if entry[0] == "op" and entry[2] != WORKER]
    assert all(fake.log.index(entry) < submitted for entry in caller)
    (wait,) = [entry for entry in fake.log if entry[0] == "wait event" and entry[1] is fake.default]
    assert wait[2].stream is worker
    assert not unordered_results(fake)
    # Every other way to take the result: the call without async_op, the future, "auto".
    line = planner.Linear(50e-6, 1e9)
    profile = planner.Profile("injected", cost_model.Link(1e6, 20e-6), {"int8": planner.Codec(line, line)}, 2)
    auto = planner.Auto(allow=("int8",), profile=profile)
    for take in (
        lambda: gradcomp.all_reduce(tensor, "int8"),
        lambda: gradcomp.all_reduce(tensor, "int8", async_op=True).get_future().wait(),
        lambda: gradcomp.all_reduce(tensor, auto),
    ):
        fake.log.clear()
        with Recorder(fake):
            take()
        assert any(entry[0] == "waited" for entry in fake.log)
        assert not unordered_results(fake)
    # The faithful future orders nothing where its value holds no tensor: a job whose
    # result is not the tensor it wrote leaves its waiter unordered.
    fake.log.clear()
    with Recorder(fake):
        collectives.queue_for(None).submit(lambda: [tensor.add_(0), None][1], tensor.device).wait()
    assert unordered_results(fake)
    fake.restore()


@pytest.mark.slow
def test_all_reduce_results_are_ordered_on_the_callers_stream_however_taken():
    run_ranks(_results_are_ordered_on_the_callers_stream, 2)


def _work_completes_once_its_gpu_work_has_run(rank: int, world_size: int) -> list[bool]:
    on_cpu = gradcomp.all_reduce(torch.randn(5000), "int8", async_op=True)
    on_cpu.wait()
    seen = [on_cpu.is_completed()]  # on CPU: the future's done()
    collectives.release_queues()  # the next worker starts under the fake
    fake = install_fake()
    held = fake.hold()  # the GPU still runs what was queued before the call
    work = gradcomp.all_reduce(torch.randn(5000), "int8", async_op=True)
    work.wait()  # the host waits for the worker to issue the job, not for the GPU to run it
    seen += [work.get_future().done(), work.is_completed()]
    held.release()
    seen.append(work.is_completed())
    fake.restore()
    return seen


@pytest.mark.slow
def test_work_is_completed_only_once_the_gpu_has_run_the_reduction():
    # dist.Work.is_completed() of NCCL queries the kernels' end events; the future alone is
    # done as soon as the worker has issued the job.
    assert run_ranks(_work_completes_once_its_gpu_work_has_run, 1) == [True, True, False, True]


def _optimizer_reads_ordered_results(rank: int, world_size: int) -> None:
    from tests.ddp.models import make_model

    model = make_model()
    optimizer = gradcomp.optim.CompressedAdam(model.parameters(), lr=1e-3, compressor="int8", warmup_steps=1)
    fake = install_fake()
    for step in range(3):  # the warm-up's dense exchange, then compressed momentum
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (rank + 1 + step))
        fake.log.clear()
        with Recorder(fake):
            optimizer.step()
        assert [e for e in fake.log if e[0] == "waited"] and not unordered_results(fake), step
    fake.restore()


@pytest.mark.slow
def test_compressed_adam_reads_exchanged_updates_after_the_workers_stream():
    run_ranks(_optimizer_reads_ordered_results, 2)


def _auto_times_gpu_buckets_by_events(rank: int, world_size: int) -> None:
    from gradcomp import planner
    from gradcomp.collectives import cost_model
    from tests.ddp.models import DDP, make_model, train

    fake = install_fake()  # from the start: every bucket takes the GPU's path
    line = planner.Linear(50e-6, 1e9)
    slow = planner.Profile("injected", cost_model.Link(1e6, 20e-6), {"int8": planner.Codec(line, line)}, 2)
    model = DDP(make_model(), bucket_cap_mb=0.02)
    # No re-plan on drift: the host's clock stands for the device's here, and a slow moment
    # would re-plan at step 7, leaving the new plan nothing observed yet.
    state = gradcomp.ddp.register(
        model, "auto", allow=("int8",), profile=slow, min_numel=0, check_every=2, trial_steps=0, drift=None
    )
    train(model, rank, world_size, 9)  # planned at step 2, checks at 5 and 7
    state.flush()
    fake.restore()
    assert all(p.compressor == "int8" for p in state.plan)
    # Each bucket's time came from events around its own work on the worker's stream: up
    # to its pause and from its resumption (not the stream's waits on other buckets).
    assert all(0 < p.observed_seconds < 5 for p in state.plan), [p.observed_seconds for p in state.plan]
    timing = [entry for entry in fake.log if entry[0] == "record" and entry[2].timing]
    buckets = len(state.plan)
    # Before the plan (steps 0 and 1), an event on the backward's stream as each bucket is handed
    # over; the offsets the plan weighed come from the step before the plan's (the last: 0).
    marks = [entry for entry in timing if entry[1] is fake.default]
    assert buckets < len(marks) <= 2 * buckets  # DDP's first step has its first buckets
    offsets = state.ready_offsets
    assert len(offsets) == buckets and max(offsets) == 0.0 and min(offsets) < 0
    streams_used = {entry[1] for entry in timing if entry[1] is not fake.default}
    assert len(streams_used) == 1
    jobs = [entry for entry in timing if entry[1] is not fake.default]
    assert len(jobs) == 4 * buckets * (9 - 3)  # two intervals a bucket (int8 two_phase pauses once)
    # An interval whose events are not done yet is not read (and never waited for).
    done = [FakeEvent(fake, timing=True) for _ in range(2)]
    for event in done:
        event.record()
    fake.hold()
    pending = FakeEvent(fake, timing=True)
    pending.record()
    assert hook_timing.in_seconds({0: [done], 1: [[done[1], pending]]}) is None
    assert hook_timing.in_seconds({0: [done]})[0][0] == 0.0
    assert hook_timing.ready_offsets(done[0], [done[0], pending]) is None
    assert hook_timing.ready_offsets(done[0], done)[-1] == 0.0


@pytest.mark.slow
def test_auto_times_gpu_buckets_by_events_on_both_streams_without_waiting():
    run_ranks(_auto_times_gpu_buckets_by_events, 2)


def collectives_out_of_order(fake: FakeCuda, thread: str = "MainThread") -> list[str]:
    """Every collective ``thread`` issued before the worker had issued those of every job
    submitted before it (a job has issued them all once started: it pauses after its last;
    a job submitted as issuing none is not waited for)."""
    problems, submitted, issuing, started = [], 0, 0, 0
    for index, entry in enumerate(fake.log):
        if entry[0] == "submit":
            submitted += 1
            issuing = submitted if entry[3] else issuing
        elif entry[0] == "started":
            started += 1
        elif entry[0] == "op" and entry[2] == thread and "c10d" in entry[3] and started < issuing:
            problems.append(f"log {index}: {entry[3]} issued before job {started + 1} of {issuing} started")
    return problems


def _auto_sends_dense_gpu_buckets_natively_in_order(rank: int, world_size: int, find_unused: bool) -> None:
    from gradcomp import planner
    from gradcomp.collectives import cost_model
    from tests.ddp.models import DDP, make_model, train

    fake = install_fake()  # from the start: every bucket takes the GPU's path
    started = collectives.CollectiveQueue._start

    def slow_start(queue, job):  # a worker slower than the backward pass
        time.sleep(0.01)
        started(queue, job)

    collectives.CollectiveQueue._start = slow_start
    line = planner.Linear(50e-6, 1e9)
    slow = planner.Profile("injected", cost_model.Link(1e6, 20e-6), {"int8": planner.Codec(line, line)}, 2)
    # find_unused_parameters: DDP all-reduces its map of used parameters on the model's group
    # right after the last bucket's hook returns.
    model = DDP(make_model(), bucket_cap_mb=0.02, find_unused_parameters=find_unused)
    # Buckets under min_numel are planned dense, the others int8: a plan of both kinds.
    state = gradcomp.ddp.register(
        model, "auto", allow=("int8",), profile=slow, min_numel=10_000, trial_steps=0, drift=None
    )
    train(model, rank, world_size, 4)  # planned at the end of step 1, adopted from step 3
    state.flush()
    fake.log.clear()
    with Recorder(fake):
        train(model, rank, world_size, 3)
        state.flush()
    fake.restore()
    kinds = {p.compressor for p in state.plan}
    assert kinds == {"none", "int8"}, state.plan
    native = [e for e in fake.log if e[0] == "op" and e[2] == "MainThread" and "c10d.allreduce_" in e[3]]
    # Every dense bucket of the three steps went through torch's all-reduce on the model's
    # group (and DDP's map of used parameters once a step).
    dense = sum(p.compressor == "none" for p in state.plan)
    assert len(native) == 3 * (dense + find_unused), len(native)
    assert not collectives_out_of_order(fake), collectives_out_of_order(fake)[:5]


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.slow
def test_auto_sends_dense_gpu_buckets_through_ddps_all_reduce_in_one_order_with_the_workers(find_unused):
    run_ranks(_auto_sends_dense_gpu_buckets_natively_in_order, 2, find_unused)


def measuring_spans(fake: FakeCuda) -> list[list[tuple]]:
    """The log entries between the start and the end of each measuring (``gradcomp.plan``) job."""
    spans, span = [], None
    for entry in fake.log:
        if entry[:3] == ("start", WORKER, "gradcomp.plan"):
            span = []
        elif entry[:3] == ("started", WORKER, "gradcomp.plan"):
            spans.append(span)
            span = None
        elif span is not None:
            span.append(entry)
    return spans


def _auto_measures_gpus_at_step_boundaries(rank: int, world_size: int) -> None:
    from gradcomp import planner
    from gradcomp.collectives import cost_model
    from tests.ddp.models import DDP, make_model, train

    fake = install_fake()
    line = planner.Linear(50e-6, 1e9)
    slow = planner.Profile("injected", cost_model.Link(1e6, 20e-6), {"int8": planner.Codec(line, line)}, 2)
    agreed = planner.agreed_profile

    def probing(*args, **kwargs):  # as long as a probe takes
        time.sleep(0.3)
        return agreed(*args, **kwargs)

    planner.agreed_profile = probing
    model = DDP(make_model(), bucket_cap_mb=0.02)
    state = gradcomp.ddp.register(
        model, "auto", allow=("int8",), profile=slow, min_numel=0, check_every=2, trial_steps=0, drift=None
    )
    with Recorder(fake):
        train(model, rank, world_size, 4)  # planned at the end of step 1
        state.replan()
        train(model, rank, world_size, 5)  # checked at step 5, re-planned at the end of step 6
        state.flush()
    fake.restore()
    spans = measuring_spans(fake)
    assert len(spans) == 2 and state.auto.adopted_at == 7, (len(spans), state.auto.adopted_at)
    for span in spans:
        # The device is synchronized first; the training issues nothing until the plan is made.
        work = [entry for entry in span if entry[0] not in ("wait event", "record_stream")]
        assert work[0] == ("synchronize", WORKER), work[:3]
        assert not [entry for entry in span if entry[0] == "op" and entry[2] == "MainThread"]
    # The only host waits on the device are the measurements'.
    assert sum(entry[0] == "synchronize" for entry in fake.log) == 2


@pytest.mark.slow
def test_auto_measures_on_gpus_at_step_boundaries_while_the_training_waits():
    run_ranks(_auto_measures_gpus_at_step_boundaries, 2)


def _auto_on_a_gpu(rank: int, world_size: int, steps: int, **options):
    """A small model on the one GPU (every rank on it, over Gloo) trained ``steps`` steps
    through ``"auto"`` with ``options``; its hook state once every bucket is recorded."""
    from tests.ddp.models import DDP, batches, make_model

    torch.cuda.set_device(0)
    model = DDP(make_model().cuda(), bucket_cap_mb=0.02)
    state = gradcomp.ddp.register(model, "auto", min_numel=0, check_every=2, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for inputs, labels in batches(rank, world_size, steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs.cuda()), labels.cuda()).backward()
        optimizer.step()
    state.flush()
    torch.cuda.synchronize()
    return state


def _auto_times_buckets_on_a_gpu(rank: int, world_size: int) -> list[float]:
    # No trial: its steps would hold the checks back past these 9.
    return [p.observed_seconds for p in _auto_on_a_gpu(rank, world_size, 9, trial_steps=0).plan]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_times_buckets_by_cuda_events_on_a_gpu():
    # One rank over Gloo on CUDA tensors: every bucket planned dense, sent by torch's all-reduce and
    # timed by real events around it (NaN: never observed). A world-1 all-reduce may enqueue no
    # kernel between its two events: 0.0 is a time.
    observed = run_ranks(_auto_times_buckets_on_a_gpu, 1)
    assert observed and all(0 <= t < 5 for t in observed), observed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ready_offsets_come_from_events_on_the_stream_once_done():
    # As the hook marks buckets handed over on the backward's stream: work between the marks.
    device = torch.device("cuda", 0)
    x = torch.randn(2048, 2048, device=device)
    first = streams.timing_event(device)
    marks = []
    for _ in range(3):
        for _ in range(20):
            x = x @ x / 2048
        marks.append(streams.timing_event(device))
    torch.cuda.synchronize(device)
    offsets = hook_timing.ready_offsets(first, marks)
    assert offsets[-1] == 0.0 and offsets[0] < offsets[1] < 0


def _ranks_agree_on_a_gpu_plan(rank: int, world_size: int):
    from gradcomp import planner
    from gradcomp.collectives import cost_model

    line = planner.Linear(50e-6, 1e9)
    slow = planner.Profile("injected", cost_model.Link(1e6, 20e-6), {"int8": planner.Codec(line, line)}, 2)
    # 19 steps: the plan at step 2, then a trial of int8's two algorithms (predicted alike) in
    # three turns, to step 18.
    state = _auto_on_a_gpu(rank, world_size, 19, allow=("int8",), profile=slow)
    mine = ([(p.compressor, p.how) for p in state.plan], state.ready_offsets, state.trials)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ranks_agree_on_a_plan_made_from_cuda_events():
    # The ready marks are real events on each rank's backward stream; the plan and offsets
    # agree, and so does the trial timed by device-synchronized steps.
    everyone = run_ranks(_ranks_agree_on_a_gpu_plan, 2)
    assert everyone[0] == everyone[1] and everyone[0][0]
    (trial,) = everyone[0][2]
    assert all(0 < ms < 60_000 for ms in trial["step_ms"]) and everyone[0][0] == [
        (plan.split()[0], plan.split()[1]) for plan in trial["plans"][trial["kept"]]
    ]
    offsets = everyone[0][1]
    assert offsets is None or (max(offsets) == 0.0 and len(offsets) == len(everyone[0][0]))


def _gpu_resume_measures_where_the_saved_run_did(rank: int, world_size: int, case: str) -> dict:
    import io

    from gradcomp import planner
    from gradcomp.collectives import cost_model
    from tests.ddp.models import DDP, batches, make_model

    fake = install_fake()  # every bucket takes the GPU's path
    line = planner.Linear(50e-6, 1e9)
    slow = planner.Profile("injected", cost_model.Link(1e6, 20e-6), {"int8": planner.Codec(line, line)}, 2)
    # "plan": saved before the warm-up's last step, at whose end the plan is measured; "replan":
    # saved between a check that asked for a re-plan (step 5) and its measurement (step 6's end).
    warmup, save = (5, 4) if case == "plan" else (2, 6)
    data = list(batches(rank, world_size, 9))

    def build():
        model = DDP(make_model(), bucket_cap_mb=0.02)
        state = gradcomp.ddp.register(
            model, "auto", allow=("int8",), profile=slow, min_numel=0, warmup_steps=warmup,
            check_every=2, trial_steps=0, drift=None,
        )  # fmt: skip
        return model, state, torch.optim.SGD(model.parameters(), lr=0.01)

    def run(model, state, optimizer, steps) -> tuple:
        for step in steps:
            if case == "replan" and step == 4:
                state.replan()  # the check of step 5 re-plans
            optimizer.zero_grad()
            inputs, labels = data[step]
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        state.flush()
        compressors = {s.step: sorted(set(s.compressors.values())) for s in state.stats}
        return (
            compressors,
            state.auto.adopted_at,
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        )

    model, state, optimizer = build()
    saved = io.BytesIO()
    run(model, state, optimizer, range(save))
    torch.save(
        {"model": model.module.state_dict(), "optim": optimizer.state_dict(), "hook": state.state_dict()},
        saved,
    )
    compressors, adopted, final = run(model, state, optimizer, range(save, 9))
    collectives.release_queues()
    model, state, optimizer = build()
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optim"])
    state.load_state_dict(checkpoint["hook"])
    resumed, resumed_adopted, resumed_final = run(model, state, optimizer, range(save, 9))
    fake.restore()
    assert state.auto.remeasure_due is None
    # DDP's first buckets of the resumed run are held and regrouped into the saved ones: the
    # measurement due at that step's end still comes after the last, as in the saved run.
    later = {s: c for s, c in compressors.items() if s >= save}
    return dict(
        same=torch.equal(final, resumed_final), steps=(later, resumed), adopted=(adopted, resumed_adopted)
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plan", "replan"])
def test_a_resumed_gpu_run_measures_where_the_saved_run_did(case):
    result = run_ranks(_gpu_resume_measures_where_the_saved_run_did, 2, case)
    later, resumed = result["steps"]
    assert result["same"] and later == resumed and len(set(result["adopted"])) == 1, result


def _wait_issued_waits_only_for_collectives(rank: int, world_size: int) -> None:
    q = collectives.queue_for(None)
    release = threading.Event()
    cpu = torch.device("cpu")
    q.submit(lambda: release.wait(10), cpu, collectives=False)  # statistics: no collective
    began = time.perf_counter()
    q.wait_issued()  # nothing that issues collectives was submitted
    assert time.perf_counter() - began < 1
    q.submit(lambda: None, cpu)  # behind the stalled one
    q.timeout_seconds = 0.5
    with pytest.raises(RuntimeError, match="did not issue"):
        q.wait_issued()
    release.set()
    q.wait_issued()


@pytest.mark.slow
def test_wait_issued_waits_for_the_jobs_that_issue_collectives_and_no_longer_than_the_timeout():
    run_ranks(_wait_issued_waits_only_for_collectives, 1)
