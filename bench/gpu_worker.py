"""One rank over NCCL through gradcomp's collective worker: is what callers read ordered?

Run by ``bench/gpu_check.sh`` on one GPU (``--dry-run``: CPU tensors, Gloo):

* **a collective from the worker**: at world size 1 none of gradcomp's
  algorithms issues one (a one-rank all-reduce compresses and decodes
  locally, and the agreement checks are skipped), so the check submits an
  all-gather to the group's queue (``queue_for(None).submit``) itself. It
  must run on the worker's thread, on a stream other than the caller's,
  and the gathered copy, read on the caller's stream after ``wait()``,
  must equal the input. The NCCL events of a profile of it are listed.
* **ordering**: a 256M-element fp32 tensor reduced with int8 through
  ``gradcomp.all_reduce`` (sync; ``async_op=True`` then ``Work.wait()``;
  ``Work.get_future().wait()``), its sum read on the caller's stream at once
  and again after ``torch.cuda.synchronize()``. They agree bit for bit only
  if the result is ordered on the caller's stream: a sum read while the
  worker's stream still decodes sees the tensor half written.
* **CompressedAdam**: a warm-up step and a compressed (int8) one on 64M
  parameters; their sum read at once and after a synchronize, and the
  parameters against the same steps where every wait on an all-reduce also
  synchronizes the device (an update that read its all-reduce's result
  before the worker wrote it differs).

* **FSDP2**: a model of 4 linear layers sharded with ``fully_shard`` on a one-rank
  mesh, ``gradcomp.fsdp.register(model, "int8", replicate_group=WORLD,
  parameters="int8")``: the all-reduce hook and the parameter all-gather run
  inline on FSDP's own streams. Its gradients, read on the caller's stream at
  once and after a synchronize, must agree, and lie within int8's bound of an
  unsharded copy's; then the compressed reduce-scatter itself on the one-rank
  group, rows padded (a shard not a multiple of the block), against its input.
* **FSDP2 keeps the hook's input across streams**: FSDP2 allocates a unit's
  reduce-scatter output on its reduce-scatter stream and calls gradcomp's hook on
  its all-reduce stream; the same gradients bit for bit with that stream held back
  (``torch.cuda._sleep``) before every hook call, with ``param_dtype=bf16`` and with
  two backward passes without ``zero_grad`` (bench/gpu_worker.py,
  :func:`fsdp_kept_across_streams`).
* **no host syncs in steady state**: the DDP hook (int8, Top-K, random-K), FSDP2's
  paths, CompressedAdam and DiLoCo under ``torch.cuda.set_sync_debug_mode("error")``.
* **Work.is_completed()**: an async int8 all-reduce submitted behind a sleep on the
  caller's stream (which the worker's stream waits on): after ``wait()`` (the host's
  part) it is not completed while the GPU has not run it, and is once it has.

Writes the checks under "worker" in ``<out>/gpu_check.json``; exits 1 if one
fails.

    python bench/gpu_worker.py --out bench/results
    python bench/gpu_worker.py --dry-run --out /tmp/gc
"""

from __future__ import annotations

import contextlib
import sys
import threading
from unittest import mock

import torch
from lib import gpu_setup

import gradcomp
from gradcomp.collectives.worker import all_gather_async

# Elements of the ordering check's tensor: 1 GiB of fp32, the worker's decode long
# enough for a read on another stream to catch it half done.
ORDERING_NUMEL = 256 * 2**20
ADAM_NUMEL = 64 * 2**20
COLLECTIVE_NUMEL = 2**20
DRY_RUN_NUMEL = 2**16

# How a caller waits for gradcomp.all_reduce(tensor, "int8").
WAYS = {
    "sync": lambda tensor: gradcomp.all_reduce(tensor, "int8"),
    "async_op=True, work.wait()": lambda tensor: gradcomp.all_reduce(tensor, "int8", async_op=True).wait(),
    "async_op=True, work.get_future().wait()": (
        lambda tensor: gradcomp.all_reduce(tensor, "int8", async_op=True).get_future().wait()
    ),
}


def random(numel: int, device: torch.device, seed: int) -> torch.Tensor:
    return torch.randn(numel, device=device, generator=torch.Generator(device=device).manual_seed(seed))


def sums_at_once_and_after(tensors: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """The tensors' sum (fp64) read on the caller's stream with nothing waited for,
    then again after a device-wide synchronize."""
    at_once = torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors]).sum()
    gpu_setup.synchronize(device)
    after = torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors]).sum()
    return at_once.item(), after.item()


def worker_collective(device: torch.device, numel: int, entry: dict) -> None:
    """An all-gather issued from the worker's thread, on its stream, read by the caller."""
    from torch.profiler import profile

    q = gradcomp.collectives.queue_for(None)
    tensor = random(numel, device, seed=1)
    gathered = torch.empty(q.world_size * numel, device=device)
    seen = {}

    def gather() -> torch.Tensor:
        seen.update(thread=threading.current_thread().name, stream=gpu_setup.stream_handle(device))
        all_gather_async(gathered, tensor, q.group).wait()
        return gathered  # the future then orders the caller's stream after the gather

    with profile(activities=gpu_setup.profiler_activities(device)) as trace:
        q.submit(gather, device, writes=gathered, name="gpu_check.gather").wait()
        same = torch.equal(gathered[:numel], tensor)  # on the caller's stream, no synchronize before
    caller = gpu_setup.stream_handle(device)
    nccl = sorted(
        {
            (e.get("cat"), e.get("name", ""))
            for e in gpu_setup.trace_events(trace)
            if "nccl" in e.get("name", "").lower()
        }
    )
    entry.update(
        backend=str(torch.distributed.get_backend(q.group)),
        worker_thread=seen["thread"],
        worker_stream=seen["stream"],
        caller_stream=caller,
        gathered_equals_input=same,
        nccl_events=[f"{category}: {name}" for category, name in nccl][:12],
    )
    other_stream = device.type != "cuda" or seen["stream"] != caller
    entry["ok"] = same and seen["thread"] == "gradcomp-collectives" and other_stream


def ordering(device: torch.device, numel: int, wait, entry: dict) -> None:
    """An int8 all-reduce waited for by ``wait``; its sum at once and after a synchronize."""
    tensor = random(numel, device, seed=2)
    before = tensor.sum(dtype=torch.float64).item()
    wait(tensor)
    at_once, after = sums_at_once_and_after([tensor], device)
    entry.update(sum_before=before, sum_at_once=at_once, sum_after_synchronize=after)
    entry.update(reduction_changed_the_tensor=after != before, ok=at_once == after)


class _SynchronizedFuture:
    """A future whose ``wait()`` also waits for the whole device."""

    def __init__(self, future, device: torch.device):
        self._future, self._device = future, device

    def wait(self):
        value = self._future.wait()
        gpu_setup.synchronize(self._device)
        return value


class _SynchronizedWork:
    """A :class:`gradcomp.collectives.Work` whose waits also wait for the whole device."""

    def __init__(self, work, device: torch.device):
        self._work, self._device = work, device

    def wait(self) -> bool:
        self._work.wait()
        gpu_setup.synchronize(self._device)
        return True

    def get_future(self) -> _SynchronizedFuture:
        return _SynchronizedFuture(self._work.get_future(), self._device)


# Cycles the caller's stream sleeps before the is_completed check's all-reduce: longer
# than the host takes to submit, wait for the worker and ask.
COMPLETION_DELAY_CYCLES = 200_000_000


def work_completion(device: torch.device, numel: int, entry: dict) -> None:
    """``Work.is_completed()`` after ``wait()`` with the GPU held back, then after a synchronize."""
    tensor = random(numel, device, seed=3)
    if device.type == "cuda":
        torch.cuda._sleep(COMPLETION_DELAY_CYCLES)  # on the caller's stream: the worker's waits on it
    work = gradcomp.all_reduce(tensor, "int8", async_op=True)
    work.wait()
    while_held = work.is_completed()
    gpu_setup.synchronize(device)
    after = work.is_completed()
    entry.update(completed_while_the_gpu_is_held=while_held, completed_after_synchronize=after)
    entry["ok"] = after and (device.type != "cuda" or not while_held)


def adam_steps(device: torch.device, numel: int, synchronized: bool) -> tuple[list, torch.Tensor]:
    """A warm-up and a compressed step of CompressedAdam (int8) on four parameters;
    the (at once, after synchronize) sums after each step and the final parameters.
    ``synchronized``: every wait on an all-reduce also synchronizes the device."""
    params = [torch.nn.Parameter(random(numel // 4, device, seed=10 + i)) for i in range(4)]
    optimizer = gradcomp.optim.CompressedAdam(params, lr=1e-2, compressor="int8", warmup_steps=1)
    exchanging = gradcomp.optim.compressed_adam  # the module whose all_reduce CompressedAdam calls
    original = exchanging.all_reduce

    def all_reduce(*args, **kwargs):
        work = original(*args, **kwargs)
        return _SynchronizedWork(work, device) if kwargs.get("async_op") else work

    sums = []
    with mock.patch.object(exchanging, "all_reduce", all_reduce if synchronized else original):
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = random(p.numel(), device, seed=100 * step + i)
            optimizer.step()
            sums.append(sums_at_once_and_after(params, device))
    return sums, torch.cat([p.detach().reshape(-1) for p in params])


def compressed_adam(device: torch.device, numel: int, entry: dict) -> None:
    sums, shipped = adam_steps(device, numel, synchronized=False)
    _, reference = adam_steps(device, numel, synchronized=True)
    entry.update(
        sums_at_once_and_after=sums,
        same_as_synchronized_steps=torch.equal(shipped, reference),
        max_difference=(shipped - reference).abs().max().item(),
    )
    entry["ok"] = all(at_once == after for at_once, after in sums) and entry["same_as_synchronized_steps"]


def fsdp(device: torch.device, width: int, entry: dict) -> None:
    """FSDP2 with gradcomp's comms, inline on FSDP's streams, on one rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradcomp.collectives.reduce_scatter import compressed_reduce_scatter, padded_row

    def net() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)

    model, reference = net(), net()
    mesh = init_device_mesh(device.type, (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    world = torch.distributed.group.WORLD
    state = gradcomp.fsdp.register(model, "int8", replicate_group=world, parameters="int8")
    x = random(8 * width, device, seed=5).view(8, width)
    model(x).square().mean().backward()
    grads = [p.grad.to_local() for p in model.parameters()]
    at_once, after = sums_at_once_and_after(grads, device)
    reference(x).square().mean().backward()
    full = torch.cat([g.reshape(-1) for g in grads])
    exact = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    error = ((full - exact).norm() / exact.norm()).item()
    entry.update(grad_sum_at_once=at_once, grad_sum_after_synchronize=after, relative_error=error)
    entry.update(compressors=sorted(set(state.last_stats.compressors.values())))
    # The reduce-scatter on one rank: its one row encoded, padded, sent to itself, decoded.
    c = gradcomp.get_compressor("int8")
    shard = 3 * width + 77
    rows = random(shard, device, seed=6)
    out = torch.empty_like(rows)
    residual = torch.zeros(padded_row(c, shard), device=device)
    compressed_reduce_scatter(out, rows.clone(), c, world, residual=residual)
    scatter_error = ((out - rows).norm() / rows.norm()).item()
    conserved = (out + residual[:shard] - rows).abs().max().item()
    entry.update(scatter_relative_error=scatter_error, scatter_conservation=conserved)
    entry["ok"] = at_once == after and error < 0.05 and scatter_error < 0.02 and conserved < 1e-4


# Cycles the all-reduce stream sleeps before each hook call: tens of milliseconds, so
# that FSDP's reduce-scatter stream runs ahead into the next units meanwhile.
HOOK_DELAY_CYCLES = 50_000_000


def fsdp_kept_across_streams(device: torch.device, width: int, entry: dict) -> None:
    """FSDP2's reduce-scatter output, read by gradcomp's hook on the all-reduce stream, is
    kept until that stream is done with it: the same gradients bit for bit with the
    all-reduce stream held back before every hook call (``torch.cuda._sleep``), with
    ``param_dtype=bf16`` (FSDP casts the output and frees it) and with two backward
    passes without ``zero_grad`` (it adds the output into ``.grad`` and frees it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from gradcomp.fsdp.comms import _param_groups

    def gradients(policy, delayed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)
        mesh = init_device_mesh(device.type, (1,))
        for layer in (*model, model):
            fully_shard(layer, mesh=mesh, **({} if policy is None else {"mp_policy": policy}))
        gradcomp.fsdp.register(model, "int8", replicate_group=torch.distributed.group.WORLD)
        for unit in model.modules():
            if not isinstance(unit, FSDPModule) or not delayed:
                continue
            for group in _param_groups(unit._get_fsdp_state()):

                def late(output, _hook=group._all_reduce_hook):
                    if device.type == "cuda":
                        torch.cuda._sleep(HOOK_DELAY_CYCLES)  # on the all-reduce stream, current here
                    _hook(output)

                group._all_reduce_hook = late
        x = random(8 * width, device, seed=7).view(8, width)
        for _ in range(2):  # no zero_grad: the second pass adds into .grad
            model(x).square().mean().backward()
        gpu_setup.synchronize(device)
        return torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()])

    policies = {"fp32": None, "param_dtype=bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    same = {}
    for name, policy in policies.items():
        on_time, late = gradients(policy, False), gradients(policy, True)
        same[name] = torch.equal(on_time, late)
        entry[f"{name}: max |difference|"] = (on_time - late).abs().max().item()
    entry.update(bit_identical=same, ok=all(same.values()))


def no_host_syncs(device: torch.device, width: int, entry: dict) -> None:
    """Steady-state steps of every path on one rank under ``torch.cuda.set_sync_debug_mode
    ("error")``: a synchronizing call anywhere in them (the worker thread's included)
    raises. The DDP hook (int8, Top-K, random-K), FSDP2's paths (custom HSDP, the
    compressed reduce-scatter, the parameter all-gather), CompressedAdam and DiLoCo; each
    warmed up first (agreement checks, DDP's bucket rebuild, FSDP's lazy init). CompressedAdam
    and DiLoCo may read one finite flag a step or exchange (counted). On CPU (the dry run)
    the same steps run without the mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = torch.distributed.group.WORLD

    def model() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)

    def ddp(compressor: str):
        net = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.25)
        gradcomp.ddp.register(net, compressor, min_numel=0)
        return net, torch.optim.SGD(net.parameters(), lr=0.01)

    def fsdp(**options):
        net = model()
        mesh = init_device_mesh(device.type, (1,))
        for layer in (*net, net):
            fully_shard(layer, mesh=mesh)
        gradcomp.fsdp.register(net, "int8", **options)
        return net, torch.optim.SGD(net.parameters(), lr=0.01)

    def adam():
        net = model()
        return net, gradcomp.optim.CompressedAdam(
            net.parameters(), lr=1e-3, compressor="int8", warmup_steps=1
        )

    paths = {
        "DDP hook, int8": lambda: ddp("int8"),
        "DDP hook, topk": lambda: ddp("topk"),
        "DDP hook, randk": lambda: ddp("randk"),
        "FSDP2 custom HSDP": lambda: fsdp(replicate_group=world),
        "FSDP2 reduce-scatter": lambda: fsdp(residual="fp32"),
        "FSDP2 parameter all-gather": lambda: fsdp(parameters="int8"),
        "CompressedAdam": adam,
        "DiLoCo": None,
    }
    x = random(8 * width, device, seed=8).view(8, width)
    found, finite_reads = {}, {}
    for name, make in paths.items():
        if make is None:  # DiLoCo: inner SGD steps, an outer step every second one
            net = model()
            inner = torch.optim.SGD(net.parameters(), lr=0.01)
            outer = gradcomp.DiLoCo(net, inner, sync_every=2, compressor="int4")

            def step(net=net, inner=inner, outer=outer):
                net(x).square().mean().backward()
                inner.step()
                inner.zero_grad()
                outer.step()

        else:
            net, optimizer = make()

            def step(net=net, optimizer=optimizer):
                optimizer.zero_grad()
                net(x).square().mean().backward()
                optimizer.step()

        for _ in range(3):  # warm-up
            step()
        gpu_setup.synchronize(device)
        reads = []
        try:
            with gpu_setup.sync_debug_errors(device), _finite_reads_counted(reads):
                for _ in range(2):
                    step()
            # CompressedAdam reads one flag a step and DiLoCo one an exchange (every second
            # step here), to skip or refuse a non-finite average on every rank alike.
            allowed = {"CompressedAdam": 2, "DiLoCo": 1}.get(name, 0)
            finite_reads[name], over = len(reads), len(reads) > allowed
            found[name] = f"{len(reads)} finite-flag reads, {allowed} allowed" if over else None
        except RuntimeError as error:
            found[name] = str(error).strip().splitlines()[0][:300]
        finally:
            gpu_setup.synchronize(device)
            gradcomp.collectives.release_queues()
    entry.update(
        synchronizing={name: why for name, why in found.items() if why},
        paths=list(found),
        finite_reads={name: n for name, n in finite_reads.items() if n},
    )
    entry["ok"] = not any(found.values())


@contextlib.contextmanager
def _finite_reads_counted(reads: list):
    """Within: the one host read CompressedAdam and DiLoCo make on purpose (whether a
    step's average is finite) runs outside the sync check and is counted in ``reads``."""
    modules = (gradcomp.optim.compressed_adam, gradcomp.diloco.outer_loop)  # where each reads the flag
    original = gradcomp.feedback.all_finite

    def counted(tensors):
        reads.append(len(tensors))
        previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
        if previous is not None:
            torch.cuda.set_sync_debug_mode("default")
        try:
            return original(tensors)
        finally:
            if previous is not None:
                torch.cuda.set_sync_debug_mode(previous)

    for module in modules:
        module.all_finite = counted
    try:
        yield
    finally:
        for module in modules:
            module.all_finite = original


def main(argv=None) -> int:
    args = gpu_setup.parser(__doc__).parse_args(argv)
    device = gpu_setup.device_for(args.dry_run)
    if args.dry_run:
        sizes = dict(ordering=DRY_RUN_NUMEL, adam=DRY_RUN_NUMEL, collective=DRY_RUN_NUMEL)
    else:
        sizes = dict(ordering=ORDERING_NUMEL, adam=ADAM_NUMEL, collective=COLLECTIVE_NUMEL)
    report = gpu_setup.Report(args.out, "worker", device, sizes)
    with gpu_setup.one_rank_group(device):
        with report.check("collective on the worker") as entry:
            worker_collective(device, sizes["collective"], entry)
        for way, wait in WAYS.items():
            with report.check(f"ordering: {way}") as entry:
                ordering(device, sizes["ordering"], wait, entry)
        with report.check("CompressedAdam") as entry:
            compressed_adam(device, sizes["adam"], entry)
        with report.check("FSDP2") as entry:
            fsdp(device, 256 if args.dry_run else 4096, entry)
        with report.check("FSDP2 keeps the hook's input across streams") as entry:
            fsdp_kept_across_streams(device, 256 if args.dry_run else 4096, entry)
        with report.check("no host syncs in steady state") as entry:
            no_host_syncs(device, 64 if args.dry_run else 1024, entry)
        with report.check("Work.is_completed() follows the GPU") as entry:
            work_completion(device, sizes["ordering"], entry)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
