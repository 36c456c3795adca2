//! [`DistributedDataParallel`]: gradient averaging over a process group for any derived module.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::{Collective, DistributedError, ReduceOp};
use crate::{Buffer, Forward, Module, ModuleExt, Param, Result, TensorTree};

/// PyTorch's default bucket size: 25 MiB.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// Options of [`DistributedDataParallel`].
#[derive(Debug, Clone, PartialEq)]
pub struct DdpConfig {
    /// The most bytes of gradients in one all-reduce (PyTorch's `bucket_cap_mb`, in bytes;
    /// default 25 MiB). A parameter larger than this gets a bucket of its own.
    pub bucket_cap_bytes: usize,
    /// Broadcast the buffers from rank 0 before every forward run through
    /// [`DistributedDataParallel::call`] (PyTorch's `broadcast_buffers=True`, the default).
    pub broadcast_buffers: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            broadcast_buffers: true,
        }
    }
}

impl DdpConfig {
    /// Sets the bucket size in MiB, as PyTorch's `bucket_cap_mb` (`1024 * 1024` bytes per MB).
    pub fn bucket_cap_mb(mut self, mb: f64) -> Self {
        self.bucket_cap_bytes = (mb * 1024.0 * 1024.0).max(0.0) as usize;
        self
    }

    /// Sets [`broadcast_buffers`](Self::broadcast_buffers).
    pub fn broadcast_buffers(mut self, yes: bool) -> Self {
        self.broadcast_buffers = yes;
        self
    }
}

/// Groups tensors into all-reduce buckets: `(dtype, element count)` per tensor, in order, into
/// lists of indices. A bucket holds one dtype and at most `cap_bytes` bytes, unless a single
/// tensor is larger (it then is alone in its bucket); dtypes are bucketed separately, in the
/// order they first appear, and each keeps its tensors' order. Tensors of no elements are left
/// out.
///
/// ```
/// use module_runtime::distributed::plan_buckets;
/// use module_runtime::candle_core::DType::{F16, F32};
/// // 4-byte floats, 16 bytes a bucket: [0, 1] fill one, 3 spills over, 2 is f16.
/// let plan = plan_buckets(&[(F32, 2), (F32, 2), (F16, 8), (F32, 1)], 16);
/// assert_eq!(plan, [vec![0, 1], vec![3], vec![2]]);
/// ```
pub fn plan_buckets(tensors: &[(DType, usize)], cap_bytes: usize) -> Vec<Vec<usize>> {
    let mut dtypes: Vec<DType> = Vec::new();
    for (dtype, _) in tensors {
        if !dtypes.contains(dtype) {
            dtypes.push(*dtype);
        }
    }
    let mut buckets = Vec::new();
    for dtype in dtypes {
        let mut current: Vec<usize> = Vec::new();
        let mut bytes = 0;
        for (i, (d, n)) in tensors.iter().enumerate() {
            if *d != dtype || *n == 0 {
                continue;
            }
            let size = n * dtype.size_in_bytes();
            if !current.is_empty() && bytes + size > cap_bytes {
                buckets.push(std::mem::take(&mut current));
                bytes = 0;
            }
            current.push(i);
            bytes += size;
        }
        if !current.is_empty() {
            buckets.push(current);
        }
    }
    buckets
}

/// Data-parallel training of a module: every rank holds a replica, trains on its own part of
/// each batch, and [`reduce_gradients`](Self::reduce_gradients) averages the gradients over the
/// ranks after `backward`, so the replicas take the same optimizer steps and stay equal
/// (PyTorch's `DistributedDataParallel`).
///
/// ```
/// use candle_nn::Optimizer;
/// use module_runtime::distributed::{DdpConfig, DistributedDataParallel, SingleProcess};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let comm = SingleProcess; // or `init_from_env()?` under a launcher
/// let ddp = DistributedDataParallel::new(&model, &comm, DdpConfig::default())?;
/// let mut opt = candle_nn::SGD::new(model.trainable_vars()?, 0.1)?;
///
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let loss = ddp.call(&x)?.sqr()?.mean_all()?;
/// let mut grads = loss.backward()?;
/// ddp.reduce_gradients(&mut grads)?; // averaged over the ranks
/// opt.step(&grads)?;
/// if ddp.is_main() {
///     // save checkpoints on rank 0 only: `model.save_safetensors(..)`; names have no `module.`
/// }
/// ddp.barrier()?;
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// # At construction ([`new`](Self::new))
///
/// * Every parameter and buffer must be built (a lazy model is built by a dry run first, as
///   PyTorch asks for a dummy forward before wrapping `Lazy*` modules): [`Error::Unbuilt`](crate::Error::Unbuilt).
/// * Some parameter must require a gradient, and the whole model must sit on one device.
/// * The ranks check that they built the same model: a 64-bit digest of every parameter's and
///   buffer's path, shape, dtype and `requires_grad` is broadcast from rank 0, and each rank's
///   verdict is all-reduced, so a mismatch is [`DistributedError::ModelMismatch`] on every rank,
///   naming the ranks that differ (PyTorch's `_verify_model_across_ranks`), never a hang.
/// * Parameters and buffers are broadcast from rank 0 (in place: optimizers made before see it),
///   so ranks that initialized with different seeds start equal.
///
/// # Gradients
///
/// [`reduce_gradients`](Self::reduce_gradients) averages the gradients of the trainable
/// parameters (in [`named_parameters`](crate::ModuleExt::named_parameters) order, shared ones once)
/// in size-capped buckets: each bucket is flattened into one tensor and all-reduced once, then cut
/// back into the `GradStore`, so candle's optimizers work unchanged. A parameter that got no
/// gradient on some ranks (a branch not taken) counts as zeros there and is averaged with the
/// others; one with no gradient on any rank stays without one, so optimizers skip it as in a single
/// process. The ranks agree on which is which through one small all-reduce, so unused parameters
/// never hang (no `find_unused_parameters` flag is needed). Ids are read from the parameters at
/// each call, so a model loaded or moved after `new` still works; adding or removing parameters
/// needs a new wrapper.
///
/// # Differences from PyTorch
///
/// * **No wrapper in names**: the model stays the user's value and this wrapper only borrows it,
///   so `model.state_dict()` keys are the model's own (`fc1.weight`), not PyTorch's
///   `module.fc1.weight`. Checkpoints saved from a data-parallel run load into a plain model and
///   the other way round with no key remapping. A PyTorch DDP checkpoint needs its `module.`
///   prefix stripped (a key rule in [`LoadOptions`](../module_runtime/struct.LoadOptions.html)).
/// * **No overlap with backward**: candle's `backward` returns all gradients at once and has no
///   per-gradient hooks, so the all-reduce runs after it. Buckets keep the model order (PyTorch
///   reverses it to follow backward, and has a small first bucket, both for overlap only).
/// * **`no_sync`**: candle keeps no `.grad`, so accumulating gradients locally means summing
///   `GradStore`s yourself and calling `reduce_gradients` once on the sum.
/// * **Buffers** are broadcast from rank 0 by [`call`](Self::call) (or
///   [`sync_buffers`](Self::sync_buffers)), not by the module's own `call`.
/// * **Timeouts** belong to the engine: [`LocalGroup::with_timeout`](super::LocalGroup::with_timeout)
///   and, with the `mpi` feature, `Mpi::with_timeout` turn a collective some rank never joins into
///   [`DistributedError::Timeout`]; [`SingleProcess`](super::SingleProcess) cannot get stuck.
pub struct DistributedDataParallel<'a, M: ?Sized> {
    module: &'a M,
    comm: &'a dyn Collective,
    config: DdpConfig,
    /// Trainable parameters, each once, in `named_parameters` order.
    params: Vec<(String, Param)>,
    buffers: Vec<(String, Buffer)>,
    /// Indices into `params`.
    buckets: Vec<Vec<usize>>,
}

impl<M: ?Sized> std::fmt::Debug for DistributedDataParallel<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("backend", &self.comm.backend())
            .field("config", &self.config)
            .field("buckets", &self.bucket_paths())
            .finish()
    }
}

impl<'a, M: Module> DistributedDataParallel<'a, M> {
    /// Wraps `module` for data-parallel training over `comm`: checks that it is built, on one
    /// device and the same on every rank, then broadcasts its parameters and buffers from rank
    /// 0 and plans the buckets. Every rank must call it (it runs collectives).
    pub fn new(module: &'a M, comm: &'a dyn Collective, config: DdpConfig) -> Result<Self> {
        crate::views::ensure_built(module.as_dyn(), "wrap in DistributedDataParallel")?;
        let all_params = module.named_parameters();
        let buffers = module.named_buffers();
        check_one_device(&all_params, &buffers)?;
        verify_across_ranks(comm, &all_params, &buffers)?;
        let params: Vec<(String, Param)> = all_params
            .iter()
            .filter(|(_, p)| p.requires_grad())
            .cloned()
            .collect();
        if params.is_empty() {
            return Err(DistributedError::NoTrainableParams.into());
        }
        if comm.world_size() > 1 {
            broadcast_params(comm, &all_params, config.bucket_cap_bytes)?;
            broadcast_buffers(comm, &buffers)?;
        }
        let sizes: Vec<(DType, usize)> = params
            .iter()
            .map(|(_, p)| (p.dtype(), p.elem_count()))
            .collect();
        let buckets = plan_buckets(&sizes, config.bucket_cap_bytes);
        Ok(DistributedDataParallel {
            module,
            comm,
            config,
            params,
            buffers,
            buckets,
        })
    }
}

impl<'a, M: ?Sized> DistributedDataParallel<'a, M> {
    /// The wrapped module (the user's own value: its names, state dict and methods).
    pub fn module(&self) -> &'a M {
        self.module
    }

    /// The process group.
    pub fn collective(&self) -> &'a dyn Collective {
        self.comm
    }

    /// The options it was made with.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Whether this is rank 0, the one that saves checkpoints and logs.
    pub fn is_main(&self) -> bool {
        self.comm.rank() == 0
    }

    /// Waits for every rank (for instance after rank 0 saved a checkpoint).
    pub fn barrier(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// The parameter paths of each all-reduce bucket, in the order they are reduced.
    pub fn bucket_paths(&self) -> Vec<Vec<String>> {
        self.buckets
            .iter()
            .map(|b| b.iter().map(|&i| self.params[i].0.clone()).collect())
            .collect()
    }

    /// Overwrites every buffer with rank 0's value (BatchNorm running statistics and the like).
    /// [`call`](Self::call) runs it before the forward when
    /// [`DdpConfig::broadcast_buffers`] is on.
    pub fn sync_buffers(&self) -> Result<()> {
        if self.comm.world_size() > 1 {
            broadcast_buffers(self.comm, &self.buffers)?;
        }
        Ok(())
    }

    /// Averages the trainable parameters' gradients in `grads` over the ranks, in place; call it
    /// after `loss.backward()` and before the optimizer step, on every rank.
    pub fn reduce_gradients(&self, grads: &mut GradStore) -> Result<()> {
        let world = self.comm.world_size();
        let vars = self
            .params
            .iter()
            .map(|(_, p)| p.current_var())
            .collect::<Result<Vec<_>>>()?;
        // Which parameters have a gradient on how many ranks, agreed by all.
        let present: Vec<f32> = vars
            .iter()
            .map(|v| f32::from(u8::from(grads.get(v.as_tensor()).is_some())))
            .collect();
        // On the engine's device: NCCL takes only tensors on its GPU.
        let present = Tensor::new(present.as_slice(), &self.comm.device())?;
        self.comm.all_reduce(&present, ReduceOp::Sum)?;
        let present = present.to_vec1::<f32>()?;
        for bucket in &self.buckets {
            let used: Vec<usize> = bucket
                .iter()
                .copied()
                .filter(|&i| present[i] > 0.0)
                .collect();
            if used.is_empty() {
                continue;
            }
            let mut pieces = Vec::with_capacity(used.len());
            for &i in &used {
                let var = vars[i].as_tensor();
                let grad = match grads.get(var) {
                    Some(g) => g.to_dtype(var.dtype())?.flatten_all()?,
                    None => Tensor::zeros(var.elem_count(), var.dtype(), var.device())?,
                };
                pieces.push(grad);
            }
            let flat = Tensor::cat(&pieces, 0)?;
            drop(pieces);
            if world > 1 {
                self.comm.all_reduce(&flat, ReduceOp::Avg)?;
            } else {
                // The one-rank engine is the identity; still run it (it checks the layout).
                self.comm.all_reduce(&flat, ReduceOp::Sum)?;
            }
            let mut offset = 0;
            for &i in &used {
                let var = vars[i].as_tensor();
                let n = var.elem_count();
                let grad = flat.narrow(0, offset, n)?.reshape(var.shape())?;
                grads.insert(var, grad);
                offset += n;
            }
        }
        Ok(())
    }

    /// Syncs the buffers from rank 0 (when [`DdpConfig::broadcast_buffers`] is on), then calls
    /// the module with its hooks, like PyTorch's `ddp(x)`.
    pub fn call<In>(&self, input: In) -> Result<<M as Forward<In>>::Output>
    where
        M: Forward<In> + Module + Sized,
        In: TensorTree,
        <M as Forward<In>>::Output: TensorTree + 'static,
    {
        if self.config.broadcast_buffers {
            self.sync_buffers()?;
        }
        self.module.call(input)
    }
}

fn check_one_device(params: &[(String, Param)], buffers: &[(String, Buffer)]) -> Result<()> {
    let mut tensors = params
        .iter()
        .map(|(n, p)| (n, p.device()))
        .chain(buffers.iter().map(|(n, b)| (n, b.device())));
    let Some((first, device)) = tensors.next() else {
        return Ok(());
    };
    for (other, other_device) in tensors {
        if other_device.location() != device.location() {
            return Err(DistributedError::MixedDevices {
                first: first.clone(),
                first_device: format!("{:?}", device.location()),
                other: other.clone(),
                other_device: format!("{:?}", other_device.location()),
            }
            .into());
        }
    }
    Ok(())
}

/// FNV-1a, 64 bits: the same on every platform and build (std's hasher promises neither).
struct Fnv(u64);

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }

    fn field(&mut self, s: &str) {
        self.write(&(s.len() as u64).to_le_bytes());
        self.write(s.as_bytes());
    }
}

/// The digest of the model's structure.
fn digest(params: &[(String, Param)], buffers: &[(String, Buffer)]) -> u64 {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    for (name, p) in params {
        h.field("param");
        h.field(name);
        h.field(&format!("{:?}", p.shape().dims()));
        h.field(p.dtype().as_str());
        h.field(if p.requires_grad() { "grad" } else { "frozen" });
    }
    for (name, b) in buffers {
        h.field("buffer");
        h.field(name);
        h.field(&format!("{:?}", b.shape().dims()));
        h.field(b.dtype().as_str());
        h.field(if b.is_persistent() {
            "persistent"
        } else {
            "transient"
        });
    }
    h.0
}

/// Rank 0's digest and counts go to every rank; each rank's verdict comes back to all.
fn verify_across_ranks(
    comm: &dyn Collective,
    params: &[(String, Param)],
    buffers: &[(String, Buffer)],
) -> Result<()> {
    let d = digest(params, buffers);
    // 16-bit pieces are exact in f32, and so are counts below 2^24.
    let mut mine: Vec<f32> = (0..4).map(|i| ((d >> (16 * i)) & 0xffff) as f32).collect();
    mine.push(params.len() as f32);
    mine.push(buffers.len() as f32);
    let root = Tensor::new(mine.as_slice(), &comm.device())?;
    comm.broadcast(&root, 0)?;
    let root = root.to_vec1::<f32>()?;
    let mut verdict = vec![0f32; comm.world_size()];
    verdict[comm.rank()] = f32::from(u8::from(root != mine));
    let verdict = Tensor::new(verdict.as_slice(), &comm.device())?;
    comm.all_reduce(&verdict, ReduceOp::Sum)?;
    let mismatched: Vec<usize> = verdict
        .to_vec1::<f32>()?
        .iter()
        .enumerate()
        .filter(|(_, v)| **v > 0.0)
        .map(|(r, _)| r)
        .collect();
    if mismatched.is_empty() {
        return Ok(());
    }
    Err(DistributedError::ModelMismatch {
        rank: comm.rank(),
        mismatched,
        local_params: params.len(),
        local_buffers: buffers.len(),
        root_params: root[4] as usize,
        root_buffers: root[5] as usize,
    }
    .into())
}

/// Rank 0's parameter values to every rank, in buckets, written in place.
fn broadcast_params(comm: &dyn Collective, params: &[(String, Param)], cap: usize) -> Result<()> {
    let sizes: Vec<(DType, usize)> = params
        .iter()
        .map(|(_, p)| (p.dtype(), p.elem_count()))
        .collect();
    for bucket in plan_buckets(&sizes, cap) {
        let pieces = bucket
            .iter()
            .map(|&i| Ok(params[i].1.current_var()?.as_tensor().flatten_all()?))
            .collect::<Result<Vec<_>>>()?;
        let flat = Tensor::cat(&pieces, 0)?;
        comm.broadcast(&flat, 0)?;
        let mut offset = 0;
        for &i in &bucket {
            let p = &params[i].1;
            let n = p.elem_count();
            p.set(&flat.narrow(0, offset, n)?.reshape(p.shape())?)?;
            offset += n;
        }
    }
    Ok(())
}

/// Rank 0's buffer values to every rank, one buffer at a time (buffers are small and of any dtype).
fn broadcast_buffers(comm: &dyn Collective, buffers: &[(String, Buffer)]) -> Result<()> {
    for (_, b) in buffers {
        let value = b.tensor()?.flatten_all()?.copy()?;
        comm.broadcast(&value, 0)?;
        b.set(&value.reshape(b.shape())?)?;
    }
    Ok(())
}
