"""The Python snippets of the user docs (README.md and docs/usage.md), run as a user would
(adapted to CPUs and Gloo where they say so).

Each snippet the suite runs follows a marker, ``<!-- test: NAME -->``, on the line before its
code block: the tests find it by name, so that the docs can move, add or drop prose and
examples around it, and move an example from one page to the other.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import gradcomp
from tests.utils import run_ranks, same_on_all_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DOCS = (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "usage.md"))
MARKED = re.compile(r"<!-- test: ([\w-]+) -->\n```python\n(.*?)```", flags=re.S)
# Every marked block, and the test that runs it.
RUN = {
    "ddp": "test_readme_snippets_run",
    "checkpoint": "test_readme_snippets_run",
    "hierarchical": "test_readme_snippets_run",
    "auto": "test_readme_snippets_run",
    "compressed-adam": "test_readme_snippets_run",
    "diloco": "test_readme_snippets_run",
    "all-reduce": "test_readme_snippets_run",
    "lightning": "test_readme_lightning_snippet_builds_a_trainer_with_the_callback",
    "transformers": "test_readme_transformers_snippet_trains_compressed",
    "accelerate": "test_usage_accelerate_and_fabric_snippets_train_compressed",
    "fabric": "test_usage_accelerate_and_fabric_snippets_train_compressed",
    "fsdp": "test_readme_fsdp_snippet_compresses_between_replicas",
    "torchft": "test_usage_torchft_snippet_trains_and_commits",
}


def readme() -> str:
    """The user docs, one page after the other."""
    pages = []
    for path in USER_DOCS:
        with open(path) as file:
            pages.append(file.read())
    return "\n".join(pages)


def marked_blocks() -> dict[str, str]:
    """Each marked Python block of the user docs by its marker's name."""
    blocks = {}
    for name, code in MARKED.findall(readme()):
        assert name not in blocks, f"the user docs mark two blocks <!-- test: {name} -->"
        blocks[name] = code
    return blocks


def block(name: str) -> str:
    blocks = marked_blocks()
    assert name in blocks, f"the user docs have no Python block after <!-- test: {name} -->"
    return blocks[name]


def test_every_python_block_of_the_readme_is_marked_and_run():
    text = readme()
    markers = re.findall(r"<!-- test: ([\w-]+) -->", text)
    blocks = marked_blocks()
    assert len(markers) == len(blocks), "a <!-- test: --> marker is not followed by a ```python block"
    assert text.count("```python\n") == len(blocks), "a Python block of the user docs has no test marker"
    assert sorted(blocks) == sorted(RUN), "a marked block was added or removed: run it here too"


def _training(module, loader, loss_fn, lr: float, **names) -> dict:
    """The names a README training loop expects from the user's script."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    return {"gradcomp": gradcomp, "loader": loader, "loss_fn": loss_fn, "optimizer": optimizer, **names}


def _run_snippets(rank: int, world_size: int, blocks: dict[str, str], directory: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    os.chdir(directory)
    # The DDP example, on CPUs: the group is up already, and there is no GPU to move to.
    on_cpu = (
        blocks["ddp"]
        .replace('dist.init_process_group("nccl")', "pass")
        .replace("net.cuda(), device_ids=[local_rank]", "net")
    )
    assert on_cpu.count("pass") == 1 and "cuda" not in on_cpu.replace('"gloo" on CPUs', "")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    generator = torch.Generator().manual_seed(rank)
    loader = [
        (torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator))
    ] * 12
    scope = _training(net, loader, torch.nn.functional.cross_entropy, lr=0.05, net=net, local_rank=rank)
    exec(on_cpu, scope)
    assert scope["state"].last_stats.ratio > 3  # compressed after the 10 dense steps

    # The distributed checkpoint, of the model just trained: saved and loaded back.
    exec(blocks["checkpoint"], scope)
    assert os.path.isdir("checkpoint") and scope["state"].step == len(loader)
    assert len(scope["state"].feedback) > 0  # this rank's residuals came back

    # CompressedAdam, on CPUs, its warm-up shortened to fit the 12 batches.
    on_cpu = (
        blocks["compressed-adam"].replace("net.cuda()", "net").replace("warmup_steps=120", "warmup_steps=4")
    )
    assert "cuda" not in on_cpu and "warmup_steps=4" in on_cpu
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    scope.update(net=net, gradcomp=gradcomp)
    exec(on_cpu, scope)
    numel = sum(p.numel() for p in net.parameters())
    dense = gradcomp.collectives.ring_all_reduce_bytes(numel * 4, world_size)
    assert 0 < scope["optimizer"].last_bytes_sent < dense / 20  # sign updates after the warm-up
    assert same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))

    # DiLoCo, on CPUs, synchronising every 4 of the 12 batches; the 12th ends with the average.
    on_cpu = blocks["diloco"].replace("net.cuda()", "net").replace("sync_every=75", "sync_every=4")
    assert "cuda" not in on_cpu.replace("# no DDP", "") and "sync_every=4" in on_cpu
    torch.manual_seed(rank)  # each rank starts elsewhere: DiLoCo broadcasts rank 0's weights
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    scope.update(net=net, torch=torch)
    exec(on_cpu, scope)
    assert scope["outer"].outer_step == 3 and scope["outer"].last_stats.ratio > 6
    with pytest.raises(ValueError, match="past total_steps=12"):  # the run ended with the average
        scope["outer"].step()
    assert same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))

    scope = {"gradcomp": gradcomp, "grad": torch.randn(4096, generator=generator)}
    exec(blocks["all-reduce"], scope)
    assert scope["stats"].ratio > 3 and scope["work"].is_completed()
    assert scope["chosen"].compressor in gradcomp.planner.SAFE and scope["chosen"].algorithm
    assert scope["approx"].shape == scope["grad"].shape and scope["payload"].nbytes < 4096

    # "auto": dense for its warm-up, then a plan measured on this group, the same on every rank.
    model = DistributedDataParallel(torch.nn.Linear(256, 256))
    loader = [(torch.randn(8, 256, generator=generator), torch.randn(8, 256, generator=generator))] * 12
    scope = _training(model, loader, torch.nn.functional.mse_loss, lr=0.01, model=model)
    exec(blocks["auto"], scope)
    plan = scope["state"].plan
    assert len(plan) == 1 and plan[0].numel == 256 * 256 + 256 and plan[0].compressor in gradcomp.planner.SAFE
    assert isinstance(scope["state"].trials, list)
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, plan)
    assert all(p == plan for p in everyone)

    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    scope = {"gradcomp": gradcomp, "model": model}
    exec(blocks["hierarchical"], scope)
    model(torch.randn(8, 64)).sum().backward()
    assert scope["state"].last_stats.bytes_sent > 0


@pytest.mark.slow
def test_readme_snippets_run(tmp_path):
    ran = [name for name, test in RUN.items() if test == "test_readme_snippets_run"]
    run_ranks(_run_snippets, 2, {name: block(name) for name in ran}, str(tmp_path))


def test_readme_lightning_snippet_builds_a_trainer_with_the_callback():
    code = block("lightning")
    pytest.importorskip("lightning", reason="the Lightning extra is not installed")
    scope = {}
    exec(code, scope)
    callbacks = [type(c).__name__ for c in scope["trainer"].callbacks]
    assert "GradientCompression" in callbacks


def _run_transformers_snippet(rank: int, world_size: int, code: str, directory: str) -> None:
    import transformers

    # What torchrun sets; a tiny GPT-2 and a learnable dataset stand for the user's.
    ranks = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({name: str(value) for name, value in ranks.items()})
    os.chdir(directory)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    starts = torch.randint(0, 64, (48, 1), generator=torch.Generator().manual_seed(1))
    tokens = (starts + torch.arange(16)) % 64
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    scope = {"model": transformers.GPT2LMHeadModel(config), "dataset": dataset}
    on_cpu = code.replace("save_steps=500)", "save_steps=500, use_cpu=True)")  # Trainer's CPU DDP
    assert on_cpu != code
    exec(on_cpu, scope)
    (callback,) = [
        c for c in scope["trainer"].callback_handler.callbacks if type(c).__name__ == "GradcompCallback"
    ]
    assert callback.state.last_stats.ratio > 3
    assert same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in scope["model"].parameters()]))
    assert any("gradcomp/ratio" in entry for entry in scope["trainer"].state.log_history)


@pytest.mark.slow
def test_readme_transformers_snippet_trains_compressed(tmp_path):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    run_ranks(_run_transformers_snippet, 2, block("transformers"), str(tmp_path))


def _run_accelerate_and_fabric_snippets(rank: int, world_size: int, blocks: dict, directory: str) -> None:
    ranks = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({name: str(value) for name, value in ranks.items()}, NODE_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.chdir(directory)
    generator = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 32, generator=generator), torch.randint(0, 4, (96,))
    )
    on_cpu = {
        "accelerate": blocks["accelerate"].replace("Accelerator()", "Accelerator(cpu=True)"),
        "fabric": blocks["fabric"].replace('strategy="ddp"', 'accelerator="cpu", strategy="ddp"'),
    }
    for name, code in on_cpu.items():
        assert code != blocks[name]
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        loader = torch.utils.data.DataLoader(data, batch_size=16)
        scope = _training(net, loader, torch.nn.functional.cross_entropy, lr=0.05, model=net)
        exec(code, scope)
        assert scope["state"].last_stats.ratio > 3, name
        assert same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in net.parameters()])), name
        assert os.path.exists(os.path.join("checkpoint", f"gradcomp_rank{rank}.pt")), name
        gradcomp.collectives.release_queues()


@pytest.mark.slow
def test_usage_accelerate_and_fabric_snippets_train_compressed(tmp_path):
    pytest.importorskip("accelerate", reason="the transformers extra is not installed")
    pytest.importorskip("lightning", reason="the Lightning extra is not installed")
    blocks = {name: block(name) for name in ("accelerate", "fabric")}
    run_ranks(_run_accelerate_and_fabric_snippets, 2, blocks, str(tmp_path))


def _run_fsdp_snippet(rank: int, world_size: int, code: str) -> None:
    # On CPUs: a "cpu" mesh of 2 nodes of 1 rank, each unit sharded on its node alone.
    on_cpu = code.replace('init_device_mesh("cuda"', 'init_device_mesh("cpu"')
    assert on_cpu != code
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    model.blocks = list(model)
    scope = {"gradcomp": gradcomp, "model": model, "nodes": world_size, "gpus_per_node": 1}
    exec(on_cpu, scope)
    model(torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))).sum().backward()
    stats = scope["state"].last_stats
    assert stats.buckets == 3 and stats.bytes_sent_inter == stats.bytes_sent > 0 and stats.ratio > 3
    grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    assert same_on_all_ranks(grads)


@pytest.mark.slow
def test_readme_fsdp_snippet_compresses_between_replicas():
    run_ranks(_run_fsdp_snippet, 2, block("fsdp"))


@pytest.mark.slow
def test_usage_torchft_snippet_trains_and_commits():
    """The torchft snippet on one replica group with a real Manager and lighthouse (the
    failures and heals of several: tests/integrations/test_torchft.py)."""
    pytest.importorskip("torchft", reason="torchft has wheels for Linux x86-64 only")
    from tests.integrations.torchft_setup import one_replica_group

    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    before = [p.detach().clone() for p in module.parameters()]
    with one_replica_group(module.load_state_dict, module.state_dict, "readme") as manager:
        x, y = torch.randn(16, 8), torch.randn(16, 2)
        scope = {"torch": torch, "manager": manager, "module": module, "steps": 3, "x": x, "y": y}
        scope["loss_fn"] = torch.nn.functional.mse_loss
        exec(block("torchft"), scope)
        assert manager.current_step() == 3 and scope["compression"].commits == 3
        assert not any(torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))
