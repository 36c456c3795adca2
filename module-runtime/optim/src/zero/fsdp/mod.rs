//! [`FullyShardedDataParallel`]: ZeRO stage 3 (PyTorch's FSDP with `ShardingStrategy.FULL_SHARD`):
//! the parameters themselves sharded over the ranks, gathered per wrapped unit for its forward
//! and its backward.

mod gather;
mod rows;
mod state;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{Shape, Tensor, Var};
use module_core::scope::{Frame, ScopeGuard};
use module_core::{Forward, Module, Names, Param, PathPattern};
use module_distributed::{Collective, DdpConfig, DistributedDataParallel};
use module_hooks::{HookOptions, Hooks, ModuleExt, PreHookOptions, TensorTree};

use crate::error::{Error, Result};
use gather::{free, regather_before_backward, Gather, Runtime};

/// Options of [`FullyShardedDataParallel`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsdpConfig {
    /// Path patterns of the modules that are units of their own (PyTorch's `auto_wrap_policy`,
    /// as `ModuleWrapPolicy` by path): each matching module's parameters are gathered just
    /// before its forward and its backward and freed after each. The parameters outside every
    /// unit form the root unit, gathered for the whole forward and freed as their gradients are
    /// reduced. Empty (the default): the whole model is one unit.
    pub auto_wrap_policy: Vec<String>,
}

impl FsdpConfig {
    /// Sets [`auto_wrap_policy`](Self::auto_wrap_policy): `FsdpConfig::default().auto_wrap_policy(["layers.*"])`.
    pub fn auto_wrap_policy<S: Into<String>>(
        mut self,
        patterns: impl IntoIterator<Item = S>,
    ) -> Self {
        self.auto_wrap_policy = patterns.into_iter().map(Into::into).collect();
        self
    }
}

/// One sharded parameter: its path, the model's parameter (which holds the shard), and its full
/// shape.
#[derive(Clone)]
pub(super) struct Sharded {
    path: String,
    param: Param,
    shard: Var,
    shape: Shape,
    unit: usize,
}

impl Sharded {
    fn numel(&self) -> usize {
        self.shape.elem_count()
    }
}

/// Each gathered weight of a unit call: its parameter's id, the weight, and the shard it was
/// gathered from.
type Weights = Vec<(usize, Tensor, Tensor)>;

/// The weights of `weights` the unit's forward read as tensors (through the scope `scope`):
/// those its backward needs gathered again. A table only looked up by rows is not one of them.
fn read_weights(scope: &ScopeGuard, weights: &Weights) -> Vec<(Tensor, Tensor)> {
    weights
        .iter()
        .filter(|(id, _, _)| scope.was_read(*id))
        .map(|(_, w, s)| (w.clone(), s.clone()))
        .collect()
}

/// The state a unit's hooks share on this thread: the frames of the units being called, with
/// the weights each gathered.
#[derive(Default)]
struct Calls {
    /// Per open unit call, innermost last: the unit, its scope and its weights.
    open: RefCell<Vec<(usize, ScopeGuard, Weights)>>,
}

thread_local! {
    static CALLS: RefCell<std::collections::HashMap<u64, Rc<Calls>>> = RefCell::default();
}

fn calls(id: u64) -> Rc<Calls> {
    CALLS.with(|c| c.borrow_mut().entry(id).or_default().clone())
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// ZeRO stage 3: a model whose parameters are sharded over the ranks of a process group
/// (PyTorch's `FullyShardedDataParallel` with `ShardingStrategy.FULL_SHARD` and
/// `use_orig_params=True`).
///
/// Each parameter is flattened and cut into `world_size` equal pieces (the last one padded
/// with zeros, as FSDP pads its flat parameter); rank `r` keeps piece `r`, and the model's
/// [`Param`] holds that piece (a 1-D tensor), so the optimizer made over
/// [`module()`](Self::module) after wrapping trains the shards, under the parameters' paths:
/// any of module-optim's optimizers, with its groups by path pattern, schedules and
/// checkpoints. The full model never exists on one rank after construction.
///
/// [`call`](Self::call) runs the model's forward with every *unit* (the modules matching
/// [`FsdpConfig::auto_wrap_policy`], and the root) reading its parameters gathered:
///
/// * just before a unit's forward, each of its parameters is all-gathered from the shards, as
///   the output of an op on the shard (so the gradient flows to the shard); its storage is
///   emptied after the unit's forward, while the graph still holds the tensor;
/// * in `loss.backward()`, an identity on the unit's outputs gathers the weights again before
///   any gradient inside the unit is computed; the gather op's backward reduce-scatters
///   (averages over the ranks) each full gradient into the shard's gradient and frees the
///   weight, so the `GradStore` only ever holds shard gradients, and a full gradient lives only
///   while its unit's backward runs;
/// * the root unit's parameters (those outside every unit: an embedding tied to the output
///   projection) are gathered for the whole forward and freed as their gradients are reduced;
/// * an `Embedding` looks its rows up through the shard
///   ([`Param::scoped_rows`]): the rows are read from the gathered table in the forward, and
///   their gradient is added into one table-sized buffer and reduce-scattered into the shard's
///   in the backward, so a table is never gathered again for its backward (a weight that the
///   unit's forward read whole, as a tied output projection does, still is).
///
/// The gradients in the `GradStore` are then already the averages of data parallelism: step the
/// optimizer with them directly, after [`clip_grad_norm`](Self::clip_grad_norm) if clipping.
///
/// ```
/// use std::rc::Rc;
/// use module_runtime::distributed::{Collective, SingleProcess};
/// use module_runtime::optim::{FsdpConfig, FullyShardedDataParallel};
/// use module_runtime::prelude::*;
///
/// #[derive(Module)]
/// struct Net { layers: Vec<Linear> }
/// impl Forward<&Tensor> for Net {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         self.layers.iter().try_fold(x.clone(), |x, l| l.call(&x)?.tanh().map_err(Into::into))
///     }
/// }
///
/// let net = Net { layers: vec![Linear::new(4, 8, &Device::Cpu)?, Linear::new(8, 2, &Device::Cpu)?] };
/// let comm: Rc<dyn Collective> = Rc::new(SingleProcess); // `init_from_env()?.into()` under a launcher
/// let fsdp = FullyShardedDataParallel::new(net, comm, FsdpConfig::default().auto_wrap_policy(["layers.*"]))?;
/// assert_eq!(fsdp.units(), ["", "layers.0", "layers.1"]);
/// let mut opt = AdamW::new(fsdp.module(), AdamW::options().lr(1e-3))?; // over the shards
///
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let mut grads = fsdp.call(&x)?.sqr()?.mean_all()?.backward()?; // shard gradients, averaged
/// fsdp.clip_grad_norm(&mut grads, 1.0, 2.0)?;
/// opt.step(&grads)?;
/// let full = fsdp.state_dict()?; // FULL_STATE_DICT: `layers.0.weight` is [8, 4] again
/// assert_eq!(full.get("layers.0.weight").unwrap().dims(), [8, 4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Numerics
///
/// The forward and backward compute with the same values as data parallelism (the gather copies
/// bits), each gradient is the same sum over the ranks divided by the world size as
/// [`DistributedDataParallel::reduce_gradients`]'s, and module-optim's optimizers are
/// element-wise, so the parameters after any number of steps are bitwise those of
/// [`DistributedDataParallel`] with [`LocalGroup`](module_distributed::LocalGroup) and with MPI at
/// 2 ranks. [`clip_grad_norm`](Self::clip_grad_norm) adds the shards' partial sums, which rounds
/// differently from one process's norm (within float32 rounding).
///
/// # Differences from PyTorch
///
/// * The process group is an `Rc<dyn Collective>` (`init_from_env()?.into()`): the backward
///   reaches it through a table on the wrapper's thread, so `backward()` must run on that thread
///   while the wrapper lives (another thread gets a
///   [`DistributedError::Backend`](module_core::DistributedError::Backend) error, never a hang).
/// * Parameters are gathered one collective per parameter (FSDP flattens a unit into one
///   `FlatParameter`); no prefetching, no `SHARD_GRAD_OP`/`HYBRID_SHARD`, no CPU offload; models
///   on the CPU only (the storage is emptied and refilled in place, which candle allows there).
/// * A unit is a module that is *called* ([`ModuleExt::call`]): a module whose parameters are read
///   by its parent's forward cannot be a unit (its parameters read as their 1-D shards there, a
///   shape error), and a parameter shared by two units is refused at construction.
pub struct FullyShardedDataParallel<M> {
    module: M,
    comm: Rc<dyn Collective>,
    id: u64,
    params: Arc<Vec<Sharded>>,
    units: Vec<String>,
    hooks: Hooks,
}

impl<M> std::fmt::Debug for FullyShardedDataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardedDataParallel")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("units", &self.units)
            .finish()
    }
}

impl<M: Module> FullyShardedDataParallel<M> {
    /// Shards `module` over `comm`. Every rank must call it (it runs collectives): the ranks
    /// check that they built the same model and take rank 0's values, as
    /// [`DistributedDataParallel::new`] does; then every parameter is replaced by this rank's
    /// shard. Build the optimizer over [`module()`](Self::module) afterwards.
    ///
    /// Errors: those of `DistributedDataParallel::new`, an `auto_wrap_policy` pattern that does
    /// not parse or matches no module, a parameter off the CPU, or one shared by two units
    /// ([`Error::ShardedModel`]).
    pub fn new(module: M, comm: Rc<dyn Collective>, config: FsdpConfig) -> Result<Self> {
        DistributedDataParallel::new(&module, &*comm, DdpConfig::default())?;
        let units = find_units(&module, &config.auto_wrap_policy, comm.rank())?;
        let (rank, world) = (comm.rank(), comm.world_size());
        let unit_of = |path: &str| {
            units
                .iter()
                .enumerate()
                .filter(|(_, u)| path.starts_with(&format!("{u}.")))
                .max_by_key(|(_, u)| u.len())
                .map_or(0, |(i, _)| i + 1)
        };
        check_shared(&module, &units, &unit_of, rank)?;
        let named = module.named_parameters();
        // Checked before any parameter is replaced: an error leaves the model as it was.
        if let Some((path, param)) = named.iter().find(|(_, p)| !p.device().is_cpu()) {
            return Err(Error::ShardedModel {
                rank,
                path: path.clone(),
                reason: format!(
                    "is on {:?}: FullyShardedDataParallel shards models on the CPU",
                    param.device().location()
                ),
            });
        }
        let mut params = Vec::new();
        for (path, param) in named {
            let shape = param.shape();
            let shard = shard_of(&param.own_tensor()?, rank, world)?;
            param.replace_var(shard.clone());
            let unit = unit_of(&path);
            params.push(Sharded {
                path,
                param,
                shard,
                shape,
                unit,
            });
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        gather::register(id, Rc::new(Runtime { comm: comm.clone() }));
        let params = Arc::new(params);
        let hooks = Hooks::new();
        for (i, unit) in units.iter().enumerate() {
            register_unit_hooks(&hooks, id, unit, i + 1, &params)?;
        }
        register_root_hook(&hooks, id)?;
        let mut all_units = vec![String::new()];
        all_units.extend(units);
        Ok(FullyShardedDataParallel {
            module,
            comm,
            id,
            params,
            units: all_units,
            hooks,
        })
    }

    /// Runs the model's forward with its units' parameters gathered (PyTorch's `fsdp(x)`); see
    /// [`FullyShardedDataParallel`]. Every rank must call it.
    pub fn call<In>(&self, input: In) -> Result<<M as Forward<In>>::Output>
    where
        M: Forward<In> + Sized,
        In: TensorTree,
        <M as Forward<In>>::Output: TensorTree + 'static,
    {
        let rt = self.runtime()?;
        let root: Vec<&Sharded> = self.params.iter().filter(|s| s.unit == 0).collect();
        let (frame, weights) = gather_unit(&rt, self.id, &root)?;
        let calls = calls(self.id);
        let scope = ScopeGuard::enter(frame);
        calls.open.borrow_mut().push((0, scope, weights));
        let out = self.hooks.run(&self.module, |m| m.call(input));
        // The root's scope closes; its weights stay for the backward, which frees them.
        calls.open.borrow_mut().pop();
        Ok(out?)
    }
}

impl<M> FullyShardedDataParallel<M> {
    /// The wrapped model. Its parameters hold this rank's shards (1-D, padded): make the
    /// optimizer over it, and read or write the full values through
    /// [`summon_full_params`](Self::summon_full_params) or the state dicts.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The process group.
    pub fn collective(&self) -> &dyn Collective {
        &*self.comm
    }

    /// The units' paths: `""` (the root) first, then the wrapped modules in traversal order.
    pub fn units(&self) -> Vec<String> {
        self.units.clone()
    }

    /// The number of elements of each rank's shard of parameter `path` (its full size divided by
    /// the world size, rounded up), or `None` for a path that is not a parameter.
    pub fn shard_len(&self, path: &str) -> Option<usize> {
        self.params
            .iter()
            .find(|s| s.path == path)
            .map(|s| s.shard.elem_count())
    }

    fn runtime(&self) -> Result<Rc<Runtime>> {
        Ok(gather::runtime(self.id)?)
    }
}

impl<M> Drop for FullyShardedDataParallel<M> {
    fn drop(&mut self) {
        gather::unregister(self.id);
        CALLS.with(|c| c.borrow_mut().remove(&self.id));
    }
}

/// Rank `rank`'s piece of `value`'s flat values: `ceil(n / world)` elements (at least one), the
/// last ranks' padded with zeros.
fn shard_of(value: &Tensor, rank: usize, world: usize) -> Result<Var> {
    let flat = value.flatten_all()?;
    let n = flat.elem_count();
    let chunk = n.div_ceil(world).max(1);
    let start = (rank * chunk).min(n);
    let len = chunk.min(n - start);
    // One allocation: the shard's zeros, this rank's values copied in.
    let shard = Var::zeros(chunk, flat.dtype(), flat.device())?;
    if len > 0 {
        shard.slice_set(&flat.narrow(0, start, len)?, 0, 0)?;
    }
    Ok(shard)
}

/// The paths of the modules `patterns` wrap, in traversal order (the root is never one).
fn find_units<M: Module>(module: &M, patterns: &[String], rank: usize) -> Result<Vec<String>> {
    let modules: Vec<String> = module
        .named_modules()
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| !p.is_empty())
        .collect();
    let mut parsed = Vec::new();
    for pattern in patterns {
        let p = PathPattern::new(pattern)?;
        if !modules.iter().any(|m| p.matches(m)) {
            return Err(Error::ShardedModel {
                rank,
                path: pattern.clone(),
                reason: format!(
                    "the auto_wrap_policy pattern matches no module (modules: {})",
                    modules
                        .iter()
                        .take(8)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        parsed.push(p);
    }
    Ok(modules
        .into_iter()
        .filter(|m| parsed.iter().any(|p| p.matches(m)))
        .collect())
}

/// Refuses a parameter reached under two units (a weight tied across them): each unit gathers
/// its own parameters, so the other would read a shard (PyTorch asks for shared parameters in
/// a common ancestor unit too).
fn check_shared<M: Module>(
    module: &M,
    units: &[String],
    unit_of: &dyn Fn(&str) -> usize,
    rank: usize,
) -> Result<()> {
    let mut first: std::collections::HashMap<usize, (String, usize)> = Default::default();
    for (path, param) in module.named_parameters_with(&Names::new().keep_duplicates()) {
        let unit = unit_of(&path);
        match first.get(&param.id()) {
            Some((other, u)) if *u != unit => {
                let name = |u: usize| match u {
                    0 => "the root unit".to_owned(),
                    u => format!("unit `{}`", units[u - 1]),
                };
                return Err(Error::ShardedModel {
                    rank,
                    path: path.clone(),
                    reason: format!(
                        "is the same parameter as `{other}`, in {} while `{other}` is in {}: \
                         wrap a module that holds both, or leave them to the root unit",
                        name(unit),
                        name(*u)
                    ),
                });
            }
            Some(_) => {}
            None => {
                first.insert(param.id(), (path, unit));
            }
        }
    }
    Ok(())
}

/// All-gathers `params` (one unit's) into full weights: the frame that substitutes them for the
/// parameters, and each weight with its shard.
fn gather_unit(
    rt: &Runtime,
    id: u64,
    params: &[&Sharded],
) -> module_core::Result<(Frame, Weights)> {
    let grad = module_core::grad_mode::is_grad_enabled();
    let mut frame = Frame::default();
    let mut weights = Vec::with_capacity(params.len());
    for s in params {
        let shard = s.shard.as_tensor();
        let values = gather::all_gather(&*rt.comm, shard, s.numel())?;
        let arg = if grad && s.param.requires_grad() {
            shard.clone()
        } else {
            shard.detach()
        };
        let weight = Gather::apply(id, &arg, values, &s.shape)?;
        if s.shape.rank() == 2 {
            frame
                .rows
                .insert(s.param.id(), rows::lookup(id, &weight, &arg));
        }
        frame.params.insert(s.param.id(), weight.clone());
        weights.push((s.param.id(), weight, shard.clone()));
    }
    Ok((frame, weights))
}

/// The root's forward hook: the re-gathering identity on the model's outputs, for the root's
/// weights. They are not freed after the forward (the backward starts with them), but a second
/// `backward()` over the same graph finds them freed by the first, and gathers them again here.
fn register_root_hook(hooks: &Hooks, id: u64) -> Result<()> {
    hooks.register_forward_hook(
        "",
        move |ctx, _, outputs| {
            let calls = calls(id);
            let open = calls.open.borrow();
            let Some((0, scope, weights)) = open.last() else {
                return Ok(None);
            };
            if ctx.failed() {
                return Ok(None);
            }
            let weights = read_weights(scope, weights);
            let replaced = outputs
                .iter()
                .map(|o| regather_before_backward(id, o, &weights))
                .collect::<module_core::Result<Vec<_>>>()?;
            Ok(Some(replaced))
        },
        HookOptions::default(),
    )?;
    Ok(())
}

/// The pre-hook that gathers unit `unit` (at `path`) and the forward hook that frees it and
/// puts the re-gathering identity on its outputs.
fn register_unit_hooks(
    hooks: &Hooks,
    id: u64,
    path: &str,
    unit: usize,
    params: &Arc<Vec<Sharded>>,
) -> Result<()> {
    let mine: Arc<Vec<Sharded>> =
        Arc::new(params.iter().filter(|s| s.unit == unit).cloned().collect());
    let pattern = path.to_owned();
    hooks.register_forward_pre_hook(
        &pattern,
        move |_, _| {
            let rt = gather::runtime(id)?;
            let refs: Vec<&Sharded> = mine.iter().collect();
            let (frame, weights) = gather_unit(&rt, id, &refs)?;
            let scope = ScopeGuard::enter(frame);
            calls(id).open.borrow_mut().push((unit, scope, weights));
            Ok(None)
        },
        PreHookOptions::default(),
    )?;
    hooks.register_forward_hook(
        &pattern,
        move |ctx, _, outputs| {
            // Nothing is open for this unit when its pre-hook failed (this hook runs anyway).
            let calls = calls(id);
            let mut open = calls.open.borrow_mut();
            if open.last().is_none_or(|(u, _, _)| *u != unit) {
                return Ok(None);
            }
            let Some((_, scope, weights)) = open.pop() else {
                return Ok(None);
            };
            drop(open);
            let read = read_weights(&scope, &weights);
            drop(scope);
            let replaced = if ctx.failed() {
                None
            } else {
                Some(
                    outputs
                        .iter()
                        .map(|o| regather_before_backward(id, o, &read))
                        .collect::<module_core::Result<Vec<_>>>()?,
                )
            };
            for (_, weight, _) in &weights {
                free(weight)?;
            }
            Ok(replaced)
        },
        HookOptions::default().always_call(),
    )?;
    Ok(())
}
