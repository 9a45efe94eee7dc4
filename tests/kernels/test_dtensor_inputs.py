"""DTensor inputs (a sharded FSDP2 / tensor-parallel parameter read outside its module's forward) are
gathered explicitly by the ops: the results and gradients equal those of the plain tensors."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import pykernels.logprobs
import pykernels.lora


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def test_token_logprobs_gathers_a_sharded_weight_and_returns_its_gradient(mesh):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=generator, requires_grad=True)
    weight = torch.randn(83, 16, generator=generator)
    targets = torch.randint(0, 83, (7,), generator=generator)
    sharded = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
    plain = torch.nn.Parameter(weight.clone())
    ours = pykernels.logprobs.token_logprobs(hidden, sharded, targets, temperature=0.7)
    expected = pykernels.logprobs.token_logprobs(hidden, plain, targets, temperature=0.7)
    torch.testing.assert_close(ours, expected)
    ours.sum().backward()
    grad_sharded = sharded.grad.full_tensor()
    expected.sum().backward()
    torch.testing.assert_close(grad_sharded, plain.grad)


def test_lora_linear_gathers_sharded_adapters(mesh):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 12, generator=generator)
    weight = torch.randn(9, 12, generator=generator)
    a, b = torch.randn(3, 12, generator=generator), torch.randn(9, 3, generator=generator)
    sharded_a = torch.nn.Parameter(distribute_tensor(a.clone(), mesh, [Shard(0)]))
    sharded_b = torch.nn.Parameter(distribute_tensor(b.clone(), mesh, [Shard(0)]))
    plain_a, plain_b = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    ours = pykernels.lora.lora_linear(x, distribute_tensor(weight, mesh, [Shard(0)]), sharded_a, sharded_b, 2.0)
    expected = pykernels.lora.lora_linear(x, weight, plain_a, plain_b, 2.0)
    torch.testing.assert_close(ours, expected)
    ours.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(sharded_a.grad.full_tensor(), plain_a.grad)
    torch.testing.assert_close(sharded_b.grad.full_tensor(), plain_b.grad)
