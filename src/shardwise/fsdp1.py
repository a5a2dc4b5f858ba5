"""FSDP1's `FullyShardedDataParallel`, from shardwise: code written for FSDP1, unchanged.

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP    # FSDP1
    from shardwise.fsdp1 import FullyShardedDataParallel as FSDP           # shardwise

or, for a framework that imports FSDP1 itself (Accelerate with `fsdp_version: 1`,
Lightning's `FSDPStrategy`), `sw.patch_fsdp1()` in every rank (fsdp1_patch.py).

The wrapper is FSDP1's shape on shardwise's engine: an `nn.Module` holding the user's module as
`_fsdp_wrapped_module` (`.module`), which `shard_model` shards with the constructor's knobs
(FSDP1's own objects: engine/core/policies.py); units are the wrapped module and the modules
the policy picks, each a shardwise unit (not a nested wrapper: `fsdp_modules` gives a view
per unit, [Note: FSDP1 units]). Parameters are the original ones, as DTensors (FSDP1's
`use_orig_params=True`; [Note: use_orig_params] below). State dicts follow FSDP1's
`state_dict_type`: FULL gives full tensors (original buffer dtypes), SHARDED DTensors (FSDP1:
ShardedTensors), LOCAL each rank's plain shard of each parameter (FSDP1: its flat
parameter's); keys carry no wrapper prefix, as in FSDP1. Optimizer state dicts go through
torch's DCP helpers, keyed by FQN as FSDP1's are. docs/porting.md lists every call and where
it differs.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

from .checkpoint.state_dict import full_state_dict, load_full_state_dict
from .engine.api.fully_shard import fully_shard, reshard_between_steps, shard_model
from .engine.api.sharded_module import no_sync, own_unit
from .engine.comm import collectives as C
from .engine.core import dtensor as DT
from .engine.core.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    check_bool,
    check_module,
    fsdp1_buffer_dtype,
    mesh_for_strategy,
)
from .engine.core.policies import (
    ShardingStrategy as SwStrategy,
)
from .engine.ext.grad_norm import clip_grad_norm_
from .engine.ext.mixed_precision import recast_master

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]

_WRAPPED = "_fsdp_wrapped_module"
_PREFIX = _WRAPPED + "."

# FSDP1's default for each state-dict type: (model config, optimizer config).
_CONFIGS: dict[StateDictType, tuple[type, type]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def clean_name(name: str) -> str:
    """An FQN without the wrappers' `_fsdp_wrapped_module.` parts (FSDP1's clean names)."""
    return name.replace(_PREFIX, "").replace("." + _WRAPPED, "").replace(_WRAPPED, "")


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: {allowed}")


class FullyShardedDataParallel(nn.Module):
    """FSDP1's constructor and methods over shardwise's units.

    [Note: use_orig_params] FSDP1 with `use_orig_params=False` (its default) gives the
    optimizer one flat parameter per unit. shardwise keeps the original parameters (as
    DTensors) either way: an optimizer that treats each element alike (SGD, Adam, AdamW,
    Adagrad, RMSprop, with one parameter group, which flat parameters force) takes the same
    steps on them, and FSDP1's optimizer state dicts are keyed by the original names in both
    modes, as here. What differs is what a script sees of the flat parameter itself:
    `model.parameters()` yields one tensor per original parameter, and nothing has the
    `_fsdp_flattened` mark (Lightning reads it to take its `use_orig_params=True` path).

    [Note: FSDP1 units] FSDP1's auto wrapping puts a nested instance on each module its
    policy picks; here those modules become shardwise units inside the one wrapper and stay
    in the model as they were (`model.blocks[0]` is still the Block). Code that counts or
    walks FSDP1's instances (`FSDP.fsdp_modules(model)`) gets one per unit all the same, in
    FSDP1's order: each wrapper, and for each unit inside it a `_UnitView`, an instance that
    is nobody's submodule. Each answers `_has_params`, `_flat_param` (`_FlatParamView`) and
    `_handle` as far as Accelerate reads them: under mixed precision it upcasts every
    low-precision flat parameter to fp32 after wrapping (`param.data =
    param.data.to(torch.float32)`), which here stores that unit's master shards in fp32
    (ext/mixed_precision.py's `recast_master`), so a model loaded in bf16 trains fp32
    master weights as under FSDP1.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Any = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        check_module("module", module)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module is already a FullyShardedDataParallel")
        for name in ("sync_module_states", "forward_prefetch", "limit_all_gathers",
                     "use_orig_params"):
            check_bool(name, locals()[name])
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise _fail("backward_prefetch", backward_prefetch,
                        "must be None or torch.distributed.fsdp.BackwardPrefetch")
        if param_init_fn is not None and not callable(param_init_fn):
            raise _fail("param_init_fn", param_init_fn, "must be None or a callable(module)")
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        parsed = SwStrategy.parse(strategy)
        mesh = _mesh(process_group, device_mesh, parsed)
        if cpu_offload is None:
            cpu_offload = CPUOffload()
        CPUOffloadPolicy.parse(cpu_offload)
        MixedPrecisionPolicy.parse(mixed_precision)
        ignored = _ignored_params(module, ignored_modules, ignored_states)
        nested = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if nested and auto_wrap_policy is not None:
            raise ValueError(
                f"auto_wrap_policy={auto_wrap_policy!r} with a module that already holds "
                f"FullyShardedDataParallel modules ({len(nested)}): FSDP1 refuses auto "
                "wrapping over manual wrapping too; pass auto_wrap_policy=None")
        device = _device(device_id)
        super().__init__()
        self._fsdp_wrapped_module = module
        # What FSDP1 callers read back: the knobs as given, FSDP1's objects.
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision if mixed_precision is not None else MixedPrecision()
        self.cpu_offload = cpu_offload
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self._use_orig_params = use_orig_params
        self._state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
        # Full-precision dtypes of the buffers FSDP1's buffer_dtype casts: FULL and SHARDED
        # state dicts give them back in these, as FSDP1's do.
        self._buffer_dtypes = {clean_name(n): b.dtype for n, b in module.named_buffers()}

        skip = {id(p) for p in ignored}
        _materialize(module, param_init_fn, device, skip)
        if device is not None and device.type != "cpu":
            _to_device(module, device, skip)
        if sync_module_states:
            _broadcast_from_first(module, mesh, skip)
        if nested:
            self._shard_over_nested(module, mesh, parsed, strategy, mixed_precision,
                                    cpu_offload, ignored)
        else:
            shard_model(module, sharding_strategy=strategy, auto_wrap_policy=auto_wrap_policy,
                        mixed_precision=mixed_precision, cpu_offload=cpu_offload, mesh=mesh,
                        ignored_params=ignored)
        if backward_prefetch is None and own_unit(module) is not None:
            module.set_prefetch(False)  # type: ignore[operator]
        self._register_state_dict_hook(_post_state_dict)
        self._register_load_state_dict_pre_hook(_pre_load_state_dict, with_module=True)

    def _shard_over_nested(self, module: nn.Module, mesh: Any, parsed: SwStrategy,
                           strategy: Any, mixed_precision: Any, cpu_offload: Any,
                           ignored: list[nn.Parameter]) -> None:
        """Manual wrapping: the inner FSDP modules are units already; this one takes the
        parameters none of them owns (fully_shard's rule), as FSDP1's outer instance does."""
        from .engine.api.fully_shard import _cast_buffers

        buffer_dtype = fsdp1_buffer_dtype(mixed_precision)
        if buffer_dtype is not None:
            _cast_buffers(module, buffer_dtype, {id(p) for p in ignored})
        fully_shard(module, mesh=mesh_for_strategy(parsed, mesh),
                    reshard_after_forward=SwStrategy.reshards_after_forward(strategy),
                    mp_policy=MixedPrecisionPolicy.parse(mixed_precision, root=True),
                    offload_policy=CPUOffloadPolicy.parse(cpu_offload), ignored_params=ignored)

    # ----------------------------------------------------------------------------------------------
    # The module FSDP1 wraps.

    @property
    def module(self) -> nn.Module:
        """The wrapped module (inside an activation-checkpoint wrapper: the module it wraps)."""
        inner = self._fsdp_wrapped_module
        return getattr(inner, "_checkpoint_wrapped_module", inner)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _WRAPPED:
                raise
            return getattr(self._modules[_WRAPPED], name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    @property
    def _has_params(self) -> bool:
        """FSDP1's flag for an instance that holds a flat parameter: here, a unit with
        parameters (Accelerate skips the others when it upcasts; [Note: FSDP1 units])."""
        unit = own_unit(self._fsdp_wrapped_module)
        return unit is not None and bool(unit.params)

    @property
    def _flat_param(self) -> _FlatParamView | None:
        """What FSDP1 code reads of this instance's flat parameter ([Note: FSDP1 units])."""
        return _FlatParamView(self._fsdp_wrapped_module) if self._has_params else None

    @property
    def _handle(self) -> Any:
        """FSDP1's FlatParamHandle, as far as Accelerate writes it (`_orig_param_dtype`,
        which the master dtype of the flat parameter view already decides here)."""
        if not self._has_params:
            return None
        handle = vars(self).get("_sw_handle")
        if handle is None:
            handle = self.__dict__["_sw_handle"] = types.SimpleNamespace(
                _orig_param_dtype=None)
        return handle

    def check_is_root(self) -> bool:
        return True

    # ----------------------------------------------------------------------------------------------
    # Training-step calls.

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication inside the block (FSDP1's no_sync)."""
        with no_sync(self._fsdp_wrapped_module):
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every rank's shards; the total norm, as in FSDP1."""
        return clip_grad_norm_(self._fsdp_wrapped_module, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise NotImplementedError(
            "FullyShardedDataParallel.register_comm_hook is not supported by shardwise: it "
            "reduce-scatters with SUM and divides itself; use FSDP2's set_all_reduce_hook on "
            "model.module (docs/porting.md)")

    # ----------------------------------------------------------------------------------------------
    # FSDP1's module-level (static) functions.

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False
                     ) -> list[FullyShardedDataParallel]:
        """One FullyShardedDataParallel per unit in `module`, in FSDP1's (pre-)order: each
        wrapper, and for each unit its policy chose, that unit's view ([Note: FSDP1
        units]). `root_only`: the outermost wrappers only."""
        if root_only:
            found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
            inner = {id(x) for m in found for x in m._fsdp_wrapped_module.modules()}
            return [m for m in found if id(m) not in inner]
        out: list[FullyShardedDataParallel] = []
        seen: set[int] = set()

        def walk(m: nn.Module, owner: FullyShardedDataParallel | None) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            if isinstance(m, FullyShardedDataParallel):
                out.append(m)
                if isinstance(m, _UnitView):
                    return
                seen.add(id(m._fsdp_wrapped_module))  # its own unit: the wrapper itself
                for c in m._fsdp_wrapped_module.children():
                    walk(c, m)
                return
            if owner is not None and own_unit(m) is not None:
                out.append(owner._unit_view(m))
            for c in m.children():
                walk(c, owner)

        walk(module, None)
        return out

    def _unit_view(self, module: nn.Module) -> FullyShardedDataParallel:
        """The FSDP1 instance that stands for `module`'s unit inside this wrapper; the same
        object on every ask."""
        views = self.__dict__.setdefault("_sw_unit_views", {})
        if id(module) not in views:
            views[id(module)] = _UnitView(self, module)
        return views[id(module)]

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config: StateDictConfig | None = None,
                            optim_state_dict_config: OptimStateDictConfig | None = None
                            ) -> StateDictSettings:
        """Set the state-dict type on every wrapper in `module`; return the previous one."""
        if not isinstance(state_dict_type, StateDictType):
            raise _fail("state_dict_type", state_dict_type,
                        "must be torch.distributed.fsdp.StateDictType.FULL_STATE_DICT, "
                        "SHARDED_STATE_DICT or LOCAL_STATE_DICT")
        model_cls, optim_cls = _CONFIGS[state_dict_type]
        if state_dict_config is None:
            state_dict_config = model_cls()
        if optim_state_dict_config is None:
            optim_state_dict_config = optim_cls()
        if type(state_dict_config) is not model_cls:
            raise _fail("state_dict_config", state_dict_config,
                        f"{state_dict_type.name} takes a {model_cls.__name__}")
        if type(optim_state_dict_config) is not optim_cls:
            raise _fail("optim_state_dict_config", optim_state_dict_config,
                        f"{state_dict_type.name} takes a {optim_cls.__name__}")
        wrappers = FullyShardedDataParallel.fsdp_modules(module)
        if not wrappers:
            raise ValueError(f"set_state_dict_type: {type(module).__name__} holds no "
                             "FullyShardedDataParallel module")
        previous = wrappers[0]._state_dict_settings
        settings = StateDictSettings(state_dict_type, state_dict_config,
                                     optim_state_dict_config)
        for w in wrappers:
            w._state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        wrappers = FullyShardedDataParallel.fsdp_modules(module)
        if not wrappers:
            raise ValueError(f"get_state_dict_type: {type(module).__name__} holds no "
                             "FullyShardedDataParallel module")
        return wrappers[0]._state_dict_settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None
                        ) -> Iterator[None]:
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, previous.state_dict_type, previous.state_dict_config,
                previous.optim_state_dict_config)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> Iterator[None]:
        """Inside the block each wrapper's module holds full (plain) parameters; with
        `writeback`, changes to them are written back to the shards on exit."""
        for name, value in (("recurse", recurse), ("writeback", writeback),
                            ("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu),
                            ("with_grads", with_grads)):
            check_bool(name, value)
        if rank0_only and writeback:
            raise ValueError("summon_full_params: rank0_only=True with writeback=True is not "
                             "allowed (as in FSDP1): the other ranks would not write back")
        roots = FullyShardedDataParallel.fsdp_modules(module, root_only=True)
        with contextlib.ExitStack() as stack:
            for w in roots:
                stack.enter_context(_summon(w, writeback, rank0_only, offload_to_cpu,
                                            with_grads))
            yield

    # Optimizer state: FSDP1's functions, through torch's DCP helpers on the wrapped module.

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None,
                         group: Any = None) -> dict[str, Any]:
        """The optimizer state keyed by parameter FQN, per the model's state-dict type:
        FULL gives full tensors (on rank 0 only with `rank0_only`), SHARDED DTensors."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        cfg = settings.optim_state_dict_config
        full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
        return _get_optim(model, optim, full, bool(getattr(cfg, "rank0_only", False)),
                          bool(getattr(cfg, "offload_to_cpu", False)))

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: Any = None) -> dict[str, Any]:
        """What `optim.load_state_dict` takes, from `optim_state_dict(...)`'s output (FULL:
        on rank 0 only with `rank0_only`). shardwise loads it into `optim` as it converts it;
        loading the result again changes nothing."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
        rank0 = full and bool(getattr(settings.optim_state_dict_config, "rank0_only", False))
        return _set_optim(model, optim, optim_state_dict, full, rank0)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                              optim_input: Any = None, rank0_only: bool = True,
                              group: Any = None) -> dict[str, Any]:
        _no_optim_input(optim_input)
        return _get_optim(model, optim, True, check_bool("rank0_only", rank0_only), True)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: Any = None) -> dict[str, Any]:
        return _get_optim(model, optim, False, False, False)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                    optim_input: Any = None,
                                    optim: torch.optim.Optimizer | None = None
                                    ) -> dict[str, Any]:
        _no_optim_input(optim_input)
        return _set_optim(model, _need_optim(optim), full_optim_state_dict, True, False)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None,
                                      model: nn.Module, optim_input: Any = None,
                                      optim: torch.optim.Optimizer | None = None,
                                      group: Any = None) -> dict[str, Any]:
        """Rank 0's full optimizer state, sent to every rank's shards."""
        _no_optim_input(optim_input)
        return _set_optim(model, _need_optim(optim), full_optim_state_dict or {}, True, True)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any],
                                         model: nn.Module, optim: torch.optim.Optimizer
                                         ) -> dict[str, Any]:
        return _set_optim(model, optim, sharded_optim_state_dict, False, False)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict[str, Any],
                               optim_state_key_type: OptimStateKeyType, model: nn.Module,
                               optim_input: Any = None,
                               optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Re-key between FQNs (PARAM_NAME) and the positions of `model.parameters()`
        (PARAM_ID), as FSDP1 does for its full optimizer state dicts."""
        _no_optim_input(optim_input)
        if optim is not None:
            params = [p for g in optim.param_groups for p in g["params"]]
            names = {id(p): clean_name(n) for n, p in model.named_parameters()}
            order = [names[id(p)] for p in params]
        else:
            order = [clean_name(n) for n, _ in model.named_parameters()]
        if optim_state_key_type is OptimStateKeyType.PARAM_ID:
            key = {n: i for i, n in enumerate(order)}
        elif optim_state_key_type is OptimStateKeyType.PARAM_NAME:
            key = dict(enumerate(order))
        else:
            raise _fail("optim_state_key_type", optim_state_key_type,
                        "must be OptimStateKeyType.PARAM_ID or PARAM_NAME")
        return {
            "state": {key.get(k, k): v for k, v in optim_state_dict.get("state", {}).items()},
            "param_groups": [{**g, "params": [key.get(k, k) for k in g["params"]]}
                             for g in optim_state_dict.get("param_groups", [])],
        }


class _UnitView(FullyShardedDataParallel):
    """A unit the wrap policy chose inside a wrapper, as FSDP1's nested instance for
    `FSDP.fsdp_modules` ([Note: FSDP1 units]). Not a submodule of anything: the model keeps
    its own modules where FSDP1 puts wrappers."""

    def __init__(self, owner: FullyShardedDataParallel, module: nn.Module) -> None:
        nn.Module.__init__(self)
        self._fsdp_wrapped_module = module
        for attr in ("sharding_strategy", "mixed_precision", "cpu_offload", "backward_prefetch",
                     "forward_prefetch", "limit_all_gathers", "_use_orig_params",
                     "_state_dict_settings", "_buffer_dtypes"):
            setattr(self, attr, getattr(owner, attr))

    def check_is_root(self) -> bool:
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise RuntimeError("clip_grad_norm_ should only be called on the root "
                           "FullyShardedDataParallel instance (as in FSDP1)")


class _FlatParamView:
    """FSDP1's FlatParameter of one unit, as far as Accelerate uses it: its dtype, device,
    `requires_grad`, `_fqns`, and `.data`: this rank's shards flattened into one tensor;
    setting it writes the values back to the shards, stored in the new tensor's dtype
    (`param.data = param.data.to(torch.float32)` upcasts the unit's master weights).
    FSDP1 requires one dtype per flat parameter; a unit of several reads as its first."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        unit = own_unit(module)
        assert unit is not None
        self._params = [sp for sp in unit.params if sp.orig_dtype.is_floating_point]

    @property
    def dtype(self) -> torch.dtype:
        return self._params[0].orig_dtype if self._params else torch.float32

    @property
    def device(self) -> torch.device:
        return self._params[0].local.device if self._params else torch.device("cpu")

    @property
    def requires_grad(self) -> bool:
        return any(sp.requires_grad for sp in self._params)

    @property
    def _fqns(self) -> list[str]:
        return [clean_name(sp.fqn) for sp in self._params]

    @property
    def data(self) -> torch.Tensor:
        if not self._params:
            return torch.empty(0)
        return torch.cat([sp.local.detach().reshape(-1).to(self.dtype) for sp in self._params])

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        sizes = [sp.local.numel() for sp in self._params]
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != sum(
                sizes):
            raise _fail("flat parameter data", value, f"must be a 1-D tensor of {sum(sizes)} "
                        "elements (this rank's shards of the unit, flattened)")
        recast_master(self._module, value.dtype)
        with torch.no_grad():
            for sp, piece in zip(self._params, value.split(sizes), strict=True):
                sp.local.copy_(piece.view_as(sp.local))


# --------------------------------------------------------------------------------------------------
# Constructor helpers: each a check or one step of FSDP1's initialization, before sharding.


def _mesh(process_group: Any, device_mesh: Any, strategy: SwStrategy) -> DeviceMesh | None:
    """FSDP1's `process_group` / `device_mesh` as the mesh shard_model takes."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("process_group and device_mesh cannot both be given (as in FSDP1)")
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim not in (1, 2):
            raise _fail("device_mesh", device_mesh, "must be a 1-D or (for the hybrid "
                        "strategies) 2-D torch DeviceMesh")
        return device_mesh
    if process_group is None:
        return None
    if isinstance(process_group, tuple):
        raise _fail("process_group", process_group,
                    "a (intra-node, inter-node) tuple is not supported; pass device_mesh="
                    "init_device_mesh(device_type, (nodes, ranks_per_node)) instead")
    if strategy is SwStrategy.HYBRID_SHARD:
        raise _fail("process_group", process_group, "a hybrid strategy needs a 2-D "
                    "device_mesh (replicate, shard), or neither (one node per "
                    "LOCAL_WORLD_SIZE ranks)")
    if not isinstance(process_group, torch.distributed.ProcessGroup):
        raise _fail("process_group", process_group, "must be None or a ProcessGroup")
    device_type = "cuda" if C.is_initialized() and C.backend() == "nccl" else "cpu"
    return DeviceMesh.from_group(process_group, device_type)


def _device(device_id: Any) -> torch.device | None:
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        raise _fail("device_id", device_id, "must be None, an int or a torch.device")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if device_id.type == "cuda" and device_id.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device_id


def _ignored_params(module: nn.Module, ignored_modules: Any, ignored_states: Any
                    ) -> list[nn.Parameter]:
    """FSDP1's `ignored_modules` (every parameter under them) or `ignored_states` (modules
    or parameters, not both kinds) as a list of parameters."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("ignored_modules and ignored_states cannot both be given (as in "
                         "FSDP1); pass ignored_states")
    given = ignored_modules if ignored_modules is not None else ignored_states
    if given is None:
        return []
    items = [given] if isinstance(given, (nn.Module, nn.Parameter)) else list(given)
    kinds = {nn.Parameter if isinstance(x, nn.Parameter) else nn.Module if isinstance(
        x, nn.Module) else type(x) for x in items}
    what = "ignored_modules" if ignored_modules is not None else "ignored_states"
    if not kinds <= {nn.Parameter, nn.Module} or len(kinds) > 1 or (
            ignored_modules is not None and kinds != {nn.Module} and items):
        raise _fail(what, given, "must be an iterable of nn.Module"
                    + (" or of nn.Parameter (one kind)" if what == "ignored_states" else ""))
    if kinds == {nn.Parameter}:
        return items
    if any(m is module for m in items):
        raise _fail(what, given, "cannot hold the wrapped module itself")
    seen: dict[int, nn.Parameter] = {}
    for m in items:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _materialize(module: nn.Module, param_init_fn: Any, device: torch.device | None,
                 ignored: set[int]) -> None:
    """FSDP1's meta-device initialization: `param_init_fn(m)` on every module (ignored ones
    excepted), or without it `to_empty` + `reset_parameters()` per module holding meta
    tensors. Each rank draws its own values (sync_module_states then copies rank 0's)."""
    def meta(m: nn.Module, recurse: bool) -> bool:
        return any(t.is_meta for t in (*m.parameters(recurse=recurse),
                                       *m.buffers(recurse=recurse)))

    if not meta(module, True):
        return
    target = device
    if target is None:
        nccl = C.is_initialized() and C.backend() == "nccl"
        target = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device(
            "cpu")
    skip = {id(m) for m in module.modules()
            if any(id(p) in ignored for p in m.parameters(recurse=False))}
    for m in module.modules():
        if id(m) in skip:
            continue
        if param_init_fn is not None:
            param_init_fn(m)
        elif meta(m, False):
            m.to_empty(device=target, recurse=False)
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()


def _to_device(module: nn.Module, device: torch.device, ignored: set[int]) -> None:
    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and id(p) not in ignored and p.device != device:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)


def _broadcast_from_first(module: nn.Module, mesh: Any, ignored: set[int]) -> None:
    """FSDP1's `sync_module_states`: every rank starts from the model's first rank's
    parameters and buffers (over each of the mesh's dims in turn; the world without one)."""
    groups = [None] if not isinstance(mesh, DeviceMesh) else [
        mesh.get_group(d) for d in range(mesh.ndim)]
    with torch.no_grad():
        for group in groups:
            src = C.group_ranks(group)[0] if group is not None else 0
            for t in (*module.parameters(), *module.buffers()):
                if id(t) not in ignored:
                    C.broadcast(t.data, src, group)


# --------------------------------------------------------------------------------------------------
# State dicts: one hook on the wrapper turns what the wrapped (sharded) module gives into
# FSDP1's state-dict type, and one turns FSDP1's back before the wrapped module loads it.


def _post_state_dict(module: FullyShardedDataParallel, sd: dict[str, Any], prefix: str,
                     local_metadata: Any) -> dict[str, Any]:
    settings = module._state_dict_settings
    kind, cfg = settings.state_dict_type, settings.state_dict_config
    inner = prefix + _PREFIX
    keys = [k for k in sd if k.startswith(inner)]
    values = {clean_name(k[len(inner):]): sd.pop(k) for k in keys}
    if kind is StateDictType.FULL_STATE_DICT:
        rank0_only = bool(getattr(cfg, "rank0_only", False))
        full = full_state_dict(module._fsdp_wrapped_module, rank0_only=rank0_only)
        full = {clean_name(k): v for k, v in full.items()}
        device = _compute_device(module)
        offload = bool(getattr(cfg, "offload_to_cpu", False))
        values = {k: full[k] if offload or device.type == "cpu" else full[k].to(device)
                  for k in values if k in full}
    elif kind is StateDictType.LOCAL_STATE_DICT:
        values = {k: DT.local_of(v) if DT.is_dtensor(v) else v for k, v in values.items()}
    if kind is not StateDictType.LOCAL_STATE_DICT:
        for k, dtype in module._buffer_dtypes.items():
            v = values.get(k)
            if v is not None and not DT.is_dtensor(v) and v.dtype != dtype:
                values[k] = v.to(dtype)
    if kind is not StateDictType.LOCAL_STATE_DICT and getattr(cfg, "offload_to_cpu", False):
        values = {k: v.cpu() for k, v in values.items()}
    for k, v in values.items():
        sd[prefix + k] = v
    return sd


def _pre_load_state_dict(module: FullyShardedDataParallel, sd: dict[str, Any], prefix: str,
                         *args: Any) -> None:
    kind = module._state_dict_settings.state_dict_type
    inner = module._fsdp_wrapped_module
    reshard_between_steps(inner, "load_state_dict")
    params = {clean_name(n): p for n, p in inner.named_parameters(remove_duplicate=False)}
    raw = {clean_name(n): n for n, _ in inner.named_parameters(remove_duplicate=False)}
    raw.update({clean_name(n): n for n, _ in inner.named_buffers(remove_duplicate=False)})
    for key in [k for k in sd if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        name = key[len(prefix):]
        value = sd.pop(key)
        p = params.get(name)
        if p is not None and DT.is_dtensor(p) and isinstance(value, torch.Tensor) \
                and not DT.is_dtensor(value):
            value = _to_dtensor(p, value, kind)
        sd[prefix + _PREFIX + raw.get(name, name)] = value


def _to_dtensor(p: Any, value: torch.Tensor, kind: StateDictType) -> Any:
    """A FULL value (the whole tensor) or a LOCAL one (this rank's shard) as `p`'s DTensor
    face; a 0-d value is left to the engine's own hook (its face is one row)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = DT.local_of(p)
    if kind is StateDictType.LOCAL_STATE_DICT:
        return DTensor.from_local(value.to(local.device), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())
    if value.dim() == 0 or tuple(value.shape) != tuple(p.shape):
        return value
    return distribute_tensor(value.detach().to(local.device), p.device_mesh, p.placements,
                             src_data_rank=None)


def _compute_device(module: FullyShardedDataParallel) -> torch.device:
    for p in module.parameters():
        return DT.local_of(p).device if DT.is_dtensor(p) else p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _summon(w: FullyShardedDataParallel, writeback: bool, rank0_only: bool,
            offload_to_cpu: bool, with_grads: bool) -> Iterator[None]:
    inner = w._fsdp_wrapped_module
    reshard_between_steps(inner, "summon_full_params")
    full = {clean_name(k): v for k, v in full_state_dict(inner).items()}
    device = torch.device("cpu") if offload_to_cpu else _compute_device(w)
    slots: list[tuple[nn.Module, str, nn.Parameter, str]] = []
    grads: dict[int, torch.Tensor | None] = {}
    for mname, m in inner.named_modules(remove_duplicate=False):
        for pname, p in list(m._parameters.items()):
            if p is None or not DT.is_dtensor(p):
                continue
            if id(p) not in grads:
                g = p.grad
                grads[id(p)] = (g.full_tensor() if g is not None and DT.is_dtensor(g) else g) \
                    if with_grads else None
            slots.append((m, pname, p, clean_name(f"{mname}.{pname}" if mname else pname)))
    made: dict[int, nn.Parameter] = {}
    names: dict[int, str] = {}
    if not rank0_only or C.rank() == 0:
        for m, pname, p, key in slots:
            if id(p) not in made:
                made[id(p)] = nn.Parameter(full[key].to(device), requires_grad=p.requires_grad)
                g = grads[id(p)]
                if g is not None:
                    made[id(p)].grad = g.reshape(made[id(p)].shape).to(device)
                names[id(p)] = key
            m._parameters[pname] = made[id(p)]
    try:
        yield
    finally:
        for m, pname, p, _ in slots:
            m._parameters[pname] = p
        if writeback:
            load_full_state_dict(inner, {_raw_key(inner, names[i]): t.detach()
                                         for i, t in made.items()}, strict=False)


def _raw_key(inner: nn.Module, clean: str) -> str:
    for k in inner.state_dict(keep_vars=True):
        if clean_name(k) == clean:
            return k
    return clean


# --------------------------------------------------------------------------------------------------
# Optimizer state dicts, through torch.distributed.checkpoint.state_dict.


def _dcp_model(model: nn.Module) -> nn.Module:
    """The module whose FQNs are FSDP1's clean names: the wrapped module of a root wrapper."""
    return model._fsdp_wrapped_module if isinstance(model, FullyShardedDataParallel) else model


def _get_optim(model: nn.Module, optim: torch.optim.Optimizer, full: bool, rank0_only: bool,
               offload: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(_dcp_model(model), optim,
                                   options=StateDictOptions(full_state_dict=full))
    osd = _rename(osd, clean_name)
    if full and rank0_only and C.rank() != 0:
        return {}
    if offload:
        osd["state"] = {k: {n: v.cpu() if isinstance(v, torch.Tensor) and not DT.is_dtensor(v)
                            else v for n, v in s.items()} for k, s in osd["state"].items()}
    return osd


def _set_optim(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any],
               full: bool, from_rank0: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    target = _dcp_model(model)
    raw = {clean_name(n): n for n, _ in target.named_parameters()}
    osd = _rename(osd or {}, lambda k: raw.get(k, k))
    if osd and not full:
        params = dict(target.named_parameters())
        osd["state"] = {k: {n: _from_sharded_tensor(v, params.get(k), k) for n, v in s.items()}
                        for k, s in osd["state"].items()}
    if from_rank0 and C.rank() != 0:
        osd = {}
    set_optimizer_state_dict(target, optim, osd, options=StateDictOptions(
        full_state_dict=full, broadcast_from_rank0=from_rank0))
    return optim.state_dict()


def _from_sharded_tensor(value: Any, p: Any, fqn: str) -> Any:
    """A ShardedTensor (what DCP's `load_sharded_optimizer_state_dict` builds, FSDP1's
    sharded form; Lightning and Accelerate load with it) as the DTensor of parameter `p`:
    both chunk dim 0 as torch.chunk does, so this rank's shard is the same rows."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if not isinstance(value, ShardedTensor) or p is None or not DT.is_dtensor(p):
        return value
    shards = value.local_shards()
    local = shards[0].tensor if shards else torch.empty(0, *p.shape[1:], dtype=value.dtype)
    mine = DT.local_of(p)
    if tuple(local.shape) != tuple(mine.shape):
        raise ValueError(
            f"optimizer state of {fqn}: the ShardedTensor's local shard has shape "
            f"{tuple(local.shape)}, this rank's shard of the parameter {tuple(mine.shape)} "
            f"({p.placements}); load a FULL_STATE_DICT optimizer state instead")
    return DTensor.from_local(local.to(mine.device), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def _rename(osd: dict[str, Any], fn: Any) -> dict[str, Any]:
    if not osd:
        return osd
    out = dict(osd)
    out["state"] = {fn(k) if isinstance(k, str) else k: v for k, v in osd["state"].items()}
    out["param_groups"] = [{**g, "params": [fn(k) if isinstance(k, str) else k
                                            for k in g["params"]]}
                           for g in osd["param_groups"]]
    return out


def _no_optim_input(optim_input: Any) -> None:
    if optim_input is not None:
        raise _fail("optim_input", "...", "FSDP1 deprecated it and shardwise does not take "
                    "it; pass optim=<the optimizer> instead")


def _need_optim(optim: Any) -> torch.optim.Optimizer:
    if not isinstance(optim, torch.optim.Optimizer):
        raise _fail("optim", optim, "must be the torch.optim.Optimizer to load into")
    return optim

