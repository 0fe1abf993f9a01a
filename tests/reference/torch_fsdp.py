"""PyTorch's own FSDP on CPU with gloo, as torch_train.py's reference for gradsync's sharded strategies.

Reference tooling (real PyTorch 2.x), never part of the product; imported by torch_train.py only for the
strategies below, so the DDP reference still runs on torch 1.13.

Strategies (torch_train.py --strategy):
  fully-shard       FSDP2: torch.distributed.fsdp.fully_shard on a 1-D CPU device mesh of the N ranks, on every
                    unit and then on the root (reshard after forward: gradsync's fsdp-full)
  fully-shard-hsdp  FSDP2 on a 2-D CPU mesh (replicate R, shard N/R), dims ("replicate", "shard"): rank =
                    replica x (N/R) + shard index, gradsync's hsdp layout
  fsdp1-grad-op     FSDP1 FullyShardedDataParallel(sharding_strategy=SHARD_GRAD_OP, device_id=cpu,
                    use_orig_params=True), units wrapped first, the root last (gradsync's fsdp-grad-op)
  fsdp1-no-shard    the same with NO_SHARD (gradsync's fsdp-no-shard)

Units (--wrap, gradsync's names; docs/sharding.md):
  children  the elements with trainable parameters of the outermost Sequentials or ModuleLists (the module
            itself if it is one); the module's direct children with trainable parameters when it holds none
  type:T,U  every module whose class name is T or U, not descending into a match, wholly frozen ones skipped
  list:A,B  the modules of those qualified names
  none      (default) the root alone
--reduce-dtype (fully-shard*): MixedPrecisionPolicy(reduce_dtype=...) on every unit, gradsync's --reduce-dtype.
Accumulation: the first K'-1 micro-batches of a step run without gradient reduction (FSDP2:
set_requires_gradient_sync(False); FSDP1: no_sync()), as DDP's no_sync(). The full state dict and the full
optimizer state dict keyed by parameter names come from torch.distributed.checkpoint.state_dict; rank 0 saves them.
"""
import contextlib

import torch
import torch.nn as nn

STRATEGIES = ("fully-shard", "fully-shard-hsdp", "fsdp1-grad-op", "fsdp1-no-shard")


class WrapError(ValueError):
    """A --wrap or --replicas value the model or world cannot take (torch_train.py reports it as a usage error)."""


def _trainable(module):
    return any(p.requires_grad for p in module.parameters())


def _container_elements(module, prefix=""):
    """Qualified names of the elements of the outermost Sequentials / ModuleLists under `module` (itself included)."""
    if isinstance(module, (nn.Sequential, nn.ModuleList)):
        return [(f"{prefix}{name}", child) for name, child in module.named_children()]
    found = []
    for name, child in module.named_children():
        found += _container_elements(child, f"{prefix}{name}.")
    return found


def _typed(module, types, prefix=""):
    found = []
    for name, child in module.named_children():
        if type(child).__name__ in types:
            if _trainable(child):
                found.append((f"{prefix}{name}", child))
        else:
            found += _typed(child, types, f"{prefix}{name}.")
    return found


def units(module, wrap):
    """[(qualified name, submodule)] that become FSDP units besides the root, in registration order."""
    if wrap == "none":
        return []
    if wrap == "children":
        found = _container_elements(module) or list(module.named_children())
        return [(n, m) for n, m in found if _trainable(m)]
    kind, _, names = wrap.partition(":")
    wanted = [n for n in names.split(",") if n]
    if kind == "type" and wanted:
        found = _typed(module, set(wanted))
        if not found:
            raise WrapError(f"--wrap {wrap}: the model holds no trainable module of type {', '.join(wanted)}")
        return found
    if kind == "list" and wanted:
        modules = dict(module.named_modules())
        missing = [n for n in wanted if n not in modules]
        if missing:
            raise WrapError(f"--wrap {wrap}: no module named {', '.join(missing)}")
        return [(n, modules[n]) for n in modules if n in wanted]
    raise WrapError(f"--wrap {wrap!r}: expected none, children, type:T[,U] or list:A[,B]")


def check_replicas(strategy, world, replicas):
    if strategy == "fully-shard-hsdp" and (replicas <= 0 or world % replicas):
        raise WrapError(f"--replicas {replicas}: must be > 0 and divide the world size {world}")


def _mesh(strategy, world, replicas):
    from torch.distributed.device_mesh import init_device_mesh
    if strategy != "fully-shard-hsdp":
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def _set_submodule(root, name, wrapped):
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, wrapped)


REDUCE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def wrap(module, strategy, chosen, world, replicas, reduce_dtype=None):
    """The model to train: `module` with FSDP applied on the `chosen` units (deepest first) and on itself.

    reduce_dtype (fully-shard*; "fp16", "bf16", "fp32" or None): MixedPrecisionPolicy(reduce_dtype=...), the
    gradients reduced in that dtype (gradsync's --reduce-dtype)."""
    if strategy.startswith("fully-shard"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = _mesh(strategy, world, replicas)
        policy = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[reduce_dtype] if reduce_dtype else None)
        for _, unit in reversed(chosen):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        model = fully_shard(module, mesh=mesh, mp_policy=policy)
        _check_sharded(model, all(type(p).__name__ == "DTensor" for p in model.parameters()), strategy)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    sharding = ShardingStrategy.SHARD_GRAD_OP if strategy == "fsdp1-grad-op" else ShardingStrategy.NO_SHARD
    cpu = torch.device("cpu")
    for name, unit in reversed(chosen):
        _set_submodule(module, name, FSDP(unit, sharding_strategy=sharding, device_id=cpu, use_orig_params=True))
    model = FSDP(module, sharding_strategy=sharding, device_id=cpu, use_orig_params=True)
    wrapped = FSDP.fsdp_modules(model)
    _check_sharded(model, len(wrapped) == len(chosen) + 1 and all(m.sharding_strategy == sharding for m in wrapped),
                   strategy)
    return model


def _check_sharded(model, ok, strategy):
    """The reference must really be FSDP: a silent fallback to plain modules would compare gradsync with DDP."""
    if not ok:
        raise AssertionError(f"--strategy {strategy}: PyTorch did not wrap the model as asked: {model}")


def without_reduction(model, strategy):
    """Context for a micro-batch whose gradients only accumulate (not the last of its step)."""
    if not strategy.startswith("fully-shard"):
        return model.no_sync()

    @contextlib.contextmanager
    def unsynced():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return unsynced()


def _options():
    # cpu_offload=False: with it, torch 2.11's FSDP1 SHARD_GRAD_OP on CPU segfaults cloning the unsharded
    # parameters in its state-dict hook. Without it every rank gets the full dicts (tiny models here).
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=False)


def full_state(model):
    """The whole model's state dict, keys as the unwrapped module's. Every rank calls."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_options())


def full_optim_state(model, optimizer):
    """{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}. Every rank calls."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=_options())
