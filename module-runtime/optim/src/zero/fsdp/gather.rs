//! What stage 3 puts in candle's graph: the all-gathered weight as the output of a custom op on
//! the rank's shard (its backward reduce-scatters the full gradient into the shard's), the
//! identity on a unit's outputs whose backward gathers the unit's weights again, and the
//! emptying and refilling of a gathered weight's storage in place.
//!
//! candle's `backward` keeps every node of the graph alive until it returns, so a weight used in
//! the forward cannot be dropped: its *storage* is emptied after the unit's forward (every op
//! that saved the tensor shares that storage) and refilled before the unit's backward, as
//! PyTorch's FSDP resizes its flat parameter's storage to 0 and back.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, InplaceOp1, Layout, Shape, Tensor};
use module_core::DistributedError;
use module_distributed::{Collective, ReduceOp};

/// What the ops of one [`FullyShardedDataParallel`](super::FullyShardedDataParallel) need at
/// backward time: its process group. Kept in a thread-local table under the wrapper's id (the
/// ops must be `Send + Sync`, the collectives are not), so a backward runs on the thread that
/// made the wrapper.
pub(super) struct Runtime {
    pub(super) comm: Rc<dyn Collective>,
}

thread_local! {
    static RUNTIMES: RefCell<HashMap<u64, Rc<Runtime>>> = RefCell::new(HashMap::new());
}

/// Registers `runtime` under `id` on this thread.
pub(super) fn register(id: u64, runtime: Rc<Runtime>) {
    RUNTIMES.with(|r| r.borrow_mut().insert(id, runtime));
}

/// Removes the runtime of `id` (the wrapper was dropped).
pub(super) fn unregister(id: u64) {
    RUNTIMES.with(|r| r.borrow_mut().remove(&id));
}

/// The runtime of wrapper `id` on this thread, or an error naming why there is none.
pub(super) fn runtime(id: u64) -> module_core::Result<Rc<Runtime>> {
    RUNTIMES
        .with(|r| r.borrow().get(&id).cloned())
        .ok_or_else(|| {
            module_core::Error::from(DistributedError::Backend {
                backend: "FullyShardedDataParallel",
                message: "the backward of a sharded model ran on another thread than the one \
                          that made the wrapper, or after the wrapper was dropped: call \
                          `backward()` on the wrapper's thread while it lives"
                    .to_owned(),
            })
        })
}

/// A runtime error carried through candle's backward (`?` on `backward()` gives it back).
fn to_candle(e: module_core::Error) -> candle_core::Error {
    module_core::error::carry(e)
}

/// An empty storage of `like`'s dtype.
fn empty_like(like: &CpuStorage) -> candle_core::Result<CpuStorage> {
    Ok(match like {
        CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
        CpuStorage::F64(_) => CpuStorage::F64(Vec::new()),
        CpuStorage::F16(_) => CpuStorage::F16(Vec::new()),
        CpuStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
        other => candle_core::bail!(
            "FullyShardedDataParallel shards floating-point parameters, not {:?}",
            other.dtype()
        ),
    })
}

/// The number of elements a storage holds.
fn storage_len(s: &CpuStorage) -> usize {
    match s {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        _ => 0,
    }
}

/// Keeps the first `n` elements of a storage.
fn truncate(s: &mut CpuStorage, n: usize) {
    match s {
        CpuStorage::F32(v) => v.truncate(n),
        CpuStorage::F64(v) => v.truncate(n),
        CpuStorage::F16(v) => v.truncate(n),
        CpuStorage::BF16(v) => v.truncate(n),
        _ => {}
    }
}

/// A copy of the floating-point values a contiguous `layout` views in `s`.
fn copy_contiguous(s: &CpuStorage, layout: &Layout) -> candle_core::Result<CpuStorage> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("fsdp: a unit's output must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
        _ => candle_core::bail!("fsdp: a unit's output must be floating point"),
    })
}

/// Swaps a tensor's storage with the one in `slot` (in place: every view and every op that saved
/// the tensor sees the new contents).
struct Swap<'a> {
    slot: &'a Mutex<Option<CpuStorage>>,
}

impl InplaceOp1 for Swap<'_> {
    fn name(&self) -> &'static str {
        "fsdp-swap-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        let incoming = match slot.take() {
            Some(s) => s,
            None => empty_like(storage)?,
        };
        *slot = Some(std::mem::replace(storage, incoming));
        Ok(())
    }
}

/// Takes `t`'s storage out (leaving it empty) and returns it.
pub(super) fn take_storage(t: &Tensor) -> candle_core::Result<CpuStorage> {
    let slot = Mutex::new(None);
    t.inplace_op1(&Swap { slot: &slot })?;
    let taken = slot.into_inner().unwrap_or_else(PoisonError::into_inner);
    taken.ok_or_else(|| candle_core::Error::Msg("fsdp: no storage taken".to_owned()))
}

/// Empties `t`'s storage: its memory is freed while the tensor (and the graph holding it) lives.
pub(super) fn free(t: &Tensor) -> candle_core::Result<()> {
    take_storage(t).map(drop)
}

/// Whether `t`'s storage is empty (freed by [`free`]).
fn is_freed(t: &Tensor) -> candle_core::Result<bool> {
    let (storage, _) = t.storage_and_layout();
    Ok(match &*storage {
        candle_core::Storage::Cpu(s) => storage_len(s) == 0 && t.elem_count() > 0,
        _ => false,
    })
}

/// Every rank's `shard` (`chunk` elements each), concatenated in rank order and cut to the
/// parameter's `numel` elements: its flat values, as a storage.
pub(super) fn all_gather(
    comm: &dyn Collective,
    shard: &Tensor,
    numel: usize,
) -> module_core::Result<CpuStorage> {
    let world = comm.world_size();
    let out = Tensor::zeros(world * shard.elem_count(), shard.dtype(), shard.device())?;
    comm.all_gather(shard, &out)?;
    let mut storage = take_storage(&out)?;
    truncate(&mut storage, numel);
    Ok(storage)
}

/// The values an op's forward hands out, taken from its slot: an op made for one forward.
pub(super) fn take_once(
    slot: &Mutex<Option<CpuStorage>>,
    op: &str,
) -> candle_core::Result<CpuStorage> {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .ok_or_else(|| candle_core::Error::Msg(format!("fsdp: a {op} op ran twice")))
}

/// The full weight of a parameter from this rank's shard: forward hands out the values
/// all-gathered beforehand; backward reduce-scatters (averages) the full gradient into the
/// shard's and frees the full weight's storage.
pub(super) struct Gather {
    pub(super) id: u64,
    pub(super) values: Mutex<Option<CpuStorage>>,
    pub(super) shape: Shape,
}

impl Gather {
    /// The full weight of shape `shape` for `shard`, with `values` (all-gathered) as its storage.
    /// It records the op when `shard` does (a trained parameter under grad mode).
    pub(super) fn apply(
        id: u64,
        shard: &Tensor,
        values: CpuStorage,
        shape: &Shape,
    ) -> module_core::Result<Tensor> {
        let op = Gather {
            id,
            values: Mutex::new(Some(values)),
            shape: shape.clone(),
        };
        let op: Arc<Box<dyn CustomOp1 + Send + Sync>> = Arc::new(Box::new(op));
        Ok(shard.apply_op1_arc(op)?)
    }
}

impl CustomOp1 for Gather {
    fn name(&self) -> &'static str {
        "fsdp-all-gather"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((take_once(&self.values, "gather")?, self.shape.clone()))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let rt = runtime(self.id).map_err(to_candle)?;
        // The weight's last use was the gradient just computed: free it before the
        // reduce-scatter's buffers are made.
        free(res)?;
        let world = rt.comm.world_size();
        let chunk = arg.elem_count();
        let numel = grad.elem_count();
        let flat = grad.to_dtype(arg.dtype())?.flatten_all()?;
        let input = if world * chunk == numel {
            flat.contiguous()?
        } else {
            let pad = Tensor::zeros(world * chunk - numel, arg.dtype(), arg.device())?;
            Tensor::cat(&[&flat, &pad], 0)?
        };
        drop(flat);
        let out = Tensor::zeros(chunk, arg.dtype(), arg.device())?;
        rt.comm
            .reduce_scatter(&input, &out, ReduceOp::Avg)
            .map_err(to_candle)?;
        drop(input);
        Ok(Some(out))
    }
}

/// The identity on a unit's output: its backward, reached before any gradient inside the unit is
/// computed, gathers the unit's freed weights again (PyTorch's pre-backward hook of FSDP).
pub(super) struct Regather {
    pub(super) id: u64,
    /// Each freed weight, with its shard.
    pub(super) weights: Vec<(Tensor, Tensor)>,
}

impl CustomOp1 for Regather {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((copy_contiguous(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let rt = runtime(self.id).map_err(to_candle)?;
        for (weight, shard) in &self.weights {
            if is_freed(weight)? {
                let values =
                    all_gather(&*rt.comm, shard, weight.elem_count()).map_err(to_candle)?;
                let slot = Mutex::new(Some(values));
                weight.inplace_op1(&Swap { slot: &slot })?;
            }
        }
        Ok(Some(grad.clone()))
    }
}

/// `output` through a [`Regather`] of `weights` when it records gradients; as it is otherwise.
pub(super) fn regather_before_backward(
    id: u64,
    output: &Tensor,
    weights: &[(Tensor, Tensor)],
) -> module_core::Result<Tensor> {
    if !output.track_op() || weights.is_empty() {
        return Ok(output.clone());
    }
    let output = output.contiguous()?;
    let op = Regather {
        id,
        weights: weights.to_vec(),
    };
    let op: Arc<Box<dyn CustomOp1 + Send + Sync>> = Arc::new(Box::new(op));
    Ok(output.apply_op1_arc(op)?)
}
