"""torch's private members we depend on (chameleon_elastic/torch_compat.py) still exist with
the parameters we use: a torch upgrade that breaks one fails here, not in a user's job."""

from __future__ import annotations

import inspect

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from chameleon_elastic import torch_compat
from chameleon_elastic.launcher.agent import ChameleonAgent


@pytest.mark.parametrize("name", sorted(torch_compat.AGENT_HOOKS))
def test_every_agent_hook_keeps_its_parameters(name):
    method = getattr(LocalElasticAgent, name, None)
    assert method is not None, f"torch no longer has LocalElasticAgent.{name}"
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    assert params[:len(torch_compat.AGENT_HOOKS[name])] == list(torch_compat.AGENT_HOOKS[name])


@pytest.mark.parametrize("name", [n for n in sorted(torch_compat.AGENT_HOOKS)
                                  if n in vars(ChameleonAgent)])
def test_our_overrides_take_what_torch_passes(name):
    ours = [p for p in inspect.signature(getattr(ChameleonAgent, name)).parameters if p != "self"]
    theirs = [p for p in inspect.signature(getattr(LocalElasticAgent, name)).parameters
              if p != "self"]
    assert ours == theirs


def test_private_attributes_are_set_by_torchs_constructor():
    source = "".join(inspect.getsource(c.__init__) for c in LocalElasticAgent.__mro__
                     if "__init__" in vars(c) and c.__module__.startswith("torch."))
    missing = [a for a in torch_compat.PRIVATE_ATTRIBUTES if f"self.{a} " not in source
               and f"self.{a}:" not in source and f"self.{a}=" not in source]
    assert not missing, missing


def test_private_helpers_exist():
    from torch.distributed import distributed_c10d
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.launcher import api

    assert callable(api._get_addr_and_port) and callable(api._get_entrypoint_name)
    # leaving a broken NCCL world (torch_compat.abort_communicators, forget_process_groups)
    assert callable(distributed_c10d._cleanup_process_group_global_state)
    assert callable(distributed_c10d._update_default_pg)
    assert callable(distributed_c10d._coalescing_manager)
    assert hasattr(distributed_c10d._world, "pg_names")
    assert hasattr(distributed_c10d._world, "pg_coalesce_state")
    assert hasattr(distributed_c10d._world, "group_count")
    assert callable(distributed_c10d.ProcessGroup.abort)
    assert callable(distributed_c10d.ProcessGroup._get_backend)
    assert callable(DynamicRendezvousHandler._stop_heartbeats)


def test_fake_tensor_mode_sizes_a_forward_under_autocast_without_data():
    import torch

    with torch_compat.fake_tensor_mode():
        layer = torch.nn.Linear(4, 3)
        x = torch.zeros(2, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert (tuple(y.shape), y.dtype, y.requires_grad) == ((2, 3), torch.bfloat16, True)


def test_set_min_nodes_reaches_every_copy_of_a_dynamic_handlers_settings():
    """The handler, its state holder and its operation executor each keep the settings: a
    lowered minimum must reach all three, or a round would still wait for the old one."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    from chameleon_elastic.rendezvous.handler import FreshStoreRendezvousHandler

    store = HashStore()
    handler = FreshStoreRendezvousHandler.from_backend(
        "job", store, C10dRendezvousBackend(store, "job"), 2, 2, "127.0.0.1",
        RendezvousTimeout())
    torch_compat.set_min_nodes(handler, 1)
    owners = [getattr(handler, p) if p else handler
              for p in torch_compat.RENDEZVOUS_SETTINGS_HOLDERS]
    assert [o._settings.min_nodes for o in owners] == [1, 1, 1]
    assert all(o._settings.max_nodes == 2 for o in owners)


def test_both_process_contexts_keep_what_worker_process_reads():
    """A script runs in a SubprocessContext (Popen handlers), a function entry point such as
    --run-path in a MultiprocessContext (multiprocessing processes, ``_pc``)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SubprocessContext

    init = inspect.getsource(MultiprocessContext.__init__)
    for name in ("self._pc", "self._ret_vals", "self._return_values",
                 "self._worker_finished_event", "self.nprocs"):
        assert name in init or name in inspect.getsource(MultiprocessContext), name
    assert "self.subprocess_handlers" in inspect.getsource(SubprocessContext)


def test_a_failed_init_process_group_leaves_the_next_world_named_as_its_peers_name_theirs():
    """An init_process_group that times out still advances torch's group counter; forgetting
    it names the next world "0", as on the peers that never failed (else it would wait on
    other store keys than theirs)."""
    from datetime import timedelta

    import torch.distributed as dist

    with pytest.raises(RuntimeError):   # rank 1 never comes
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                timeout=timedelta(seconds=1))
    torch_compat.forget_failed_group_names()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.group.WORLD.group_name == "0"
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- per release (2.13 to 2.15)

def test_the_group_functions_take_what_runtime_groups_passes():
    """runtime/world/groups.py passes these by name on every release of the range."""
    import torch.distributed as dist

    wanted = {"init_process_group": ("backend", "timeout", "store", "rank", "world_size",
                                     "device_id"),
              "new_group": ("ranks", "timeout", "backend"),
              "split_group": ("split_ranks", "timeout")}
    for name, params in wanted.items():
        have = inspect.signature(getattr(dist, name)).parameters
        assert set(params) <= set(have), (name, sorted(set(params) - set(have)))


def test_nccl_means_nccl2_where_torch_builds_nccl2_for_the_name():
    """Against torch's own registration of ``nccl`` (2.14+ register it on first use, reading
    TORCH_DIST_USE_NCCL2 then); before 2.14 there is no nccl2."""
    import torch.distributed as dist

    if torch_compat.torch_release() < (2, 14):
        assert not torch_compat.nccl_means_nccl2()
        return
    dist.Backend._ensure_backend_registered("nccl")
    creator = dist.Backend._plugins["NCCL"].creator_fn
    assert torch_compat.nccl_means_nccl2() == ("nccl2" in creator.__name__), creator.__name__


def test_split_group_on_cpu_says_whether_a_gloo_world_splits():
    """2.15 splits a gloo world; 2.14.1 raises "No device associated with the default pg"."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        try:
            dist.split_group(split_ranks=[[0]])
            split = True
        except RuntimeError:
            split = False
        assert split == torch_compat.split_group_on_cpu()
    finally:
        dist.destroy_process_group()


def test_both_nccl_implementations_have_their_names_from_2_14():
    """plugins/cuda.py offers nccl2 and nccl-legacy; torch builds them by those names."""
    import torch.distributed as dist

    if torch_compat.torch_release() < (2, 14) or not dist.is_nccl_available():
        pytest.skip("nccl2 / nccl-legacy exist from torch 2.14, in builds with NCCL")
    for name in ("nccl2", "nccl-legacy"):
        dist.Backend._ensure_backend_registered(name)
        assert name.upper() in dist.Backend._plugins, name


def test_supports_reconfigure_says_whether_a_gloo_group_re_forms_in_place():
    """2.14+ re-form a gloo group over new members (here: the same one rank, then an
    all-reduce on it); 2.13 has no such API."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if not torch_compat.supports_reconfigure():
        assert torch_compat.torch_release() < (2, 14)
        assert not hasattr(dist, "_reconfigure")
        return
    assert "enable_reconfigure" in inspect.signature(dist.init_process_group).parameters
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5),
                                  enable_reconfigure=True)
    options = dist.distributed_c10d.ReconfigureOptions()
    options.uuid = 1
    options.handles = [group.get_reconfigure_handle()]
    group.reconfigure(options).wait()
    tensor = torch.ones(2)
    group.allreduce([tensor]).wait()
    assert tensor.tolist() == [1.0, 1.0]
