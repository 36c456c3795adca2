//! What the ranks exchange each step: the gradients (all-reduced or reduce-scattered), the
//! clipping norm, and the updated parameters (all-gathered).

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use module_distributed::{plan_buckets, ReduceOp};

use super::{all_sum, flat_grad, ZeroRedundancyOptimizer, ZeroStage};
use crate::clip;
use crate::error::{Error, Result};

/// Elements `start..start + len` of parameter `param`'s flattened values.
#[derive(Debug, Clone, Copy)]
struct Piece {
    param: usize,
    start: usize,
    len: usize,
}

/// One collective's worth of pieces: rank `r`'s segment at index `r`.
type Bucket = Vec<Vec<Piece>>;

impl<O> ZeroRedundancyOptimizer<'_, O> {
    /// The parameters (indices) that `keep` keeps, as buckets of equal-sized blocks, one per
    /// rank, of the pieces that rank owns, in order: what one all-gather or reduce-scatter moves.
    /// A bucket holds one dtype and at most the cap's share per rank of each; a parameter larger
    /// than that share is cut into pieces over consecutive buckets, so the padding of a block to
    /// the longest, and the collective's buffers, stay within the cap also around a large
    /// parameter (an embedding).
    fn plan(&self, keep: impl Fn(usize) -> bool) -> Vec<Bucket> {
        let world = self.comm.world_size();
        let share = (self.bucket_cap_bytes / world).max(1);
        let mut dtypes: Vec<DType> = Vec::new();
        for (_, p, _) in &self.params {
            if !dtypes.contains(&p.dtype()) {
                dtypes.push(p.dtype());
            }
        }
        let mut buckets = Vec::new();
        for dtype in dtypes {
            let chunk = (share / dtype.size_in_bytes()).max(1);
            let mut queues: Vec<std::collections::VecDeque<Piece>> =
                vec![Default::default(); world];
            for (i, (_, p, _)) in self.params.iter().enumerate() {
                if p.dtype() != dtype || !keep(i) {
                    continue;
                }
                let n = p.elem_count();
                for start in (0..n).step_by(chunk) {
                    let len = chunk.min(n - start);
                    queues[self.owner[i]].push_back(Piece {
                        param: i,
                        start,
                        len,
                    });
                }
            }
            while queues.iter().any(|q| !q.is_empty()) {
                let bucket: Bucket = queues
                    .iter_mut()
                    .map(|q| {
                        let (mut segment, mut filled) = (Vec::new(), 0);
                        while let Some(&piece) = q.front() {
                            if filled + piece.len > chunk {
                                break;
                            }
                            filled += piece.len;
                            segment.push(piece);
                            q.pop_front();
                        }
                        segment
                    })
                    .collect();
                buckets.push(bucket);
            }
        }
        buckets
    }

    /// Whether `piece` ends its parameter.
    fn is_last(&self, piece: &Piece) -> bool {
        piece.start + piece.len == self.params[piece.param].1.elem_count()
    }

    /// Averages the trained parameters' gradients in `grads` over the ranks; call it after
    /// `loss.backward()` on every rank, before clipping and [`step`](crate::Optimizer::step).
    ///
    /// * [`ZeroStage::One`]: every gradient is all-reduced, in size-capped buckets, as
    ///   [`DistributedDataParallel::reduce_gradients`](module_distributed::DistributedDataParallel::reduce_gradients)
    ///   does (either may be used).
    /// * [`ZeroStage::Two`]: the gradients are reduce-scattered: each rank receives the averages of
    ///   the parameters it owns, and the other gradients are removed from `grads`, their memory
    ///   freed, bucket by bucket.
    ///
    /// As with data parallelism, a parameter that got a gradient on some ranks only counts as
    /// zeros on the others, and one without a gradient on any rank stays without one (the ranks
    /// agree on which through one small all-reduce).
    pub fn reduce_gradients(&self, grads: &mut GradStore) -> Result<()> {
        let mut present = Vec::with_capacity(self.params.len());
        for (_, p, _) in &self.params {
            present.push(f64::from(u8::from(
                grads.get(p.var()?.as_tensor()).is_some(),
            )));
        }
        let present = all_sum(self.comm, &present)?;
        match self.stage {
            ZeroStage::One => self.all_reduce_grads(grads, &present),
            ZeroStage::Two => self.reduce_scatter_grads(grads, &present),
        }
    }

    /// Stage 1: DDP's buckets, all-reduced.
    fn all_reduce_grads(&self, grads: &mut GradStore, present: &[f64]) -> Result<()> {
        let sizes: Vec<(DType, usize)> = self
            .params
            .iter()
            .map(|(_, p, _)| (p.dtype(), p.elem_count()))
            .collect();
        for bucket in plan_buckets(&sizes, self.bucket_cap_bytes) {
            let used: Vec<usize> = bucket.into_iter().filter(|&i| present[i] > 0.0).collect();
            if used.is_empty() {
                continue;
            }
            let pieces = used
                .iter()
                .map(|&i| flat_grad(grads, &self.params[i].1))
                .collect::<Result<Vec<_>>>()?;
            let flat = Tensor::cat(&pieces, 0)?;
            drop(pieces);
            self.comm.all_reduce(&flat, ReduceOp::Avg)?;
            let mut offset = 0;
            for &i in &used {
                let var = self.params[i].1.var()?;
                let var = var.as_tensor();
                let n = var.elem_count();
                let grad = flat.narrow(0, offset, n)?.reshape(var.shape())?;
                grads.insert(var, grad.to_device(var.device())?);
                offset += n;
            }
        }
        Ok(())
    }

    /// Stage 2: equal blocks reduce-scattered; this rank's pieces assembled into its gradients,
    /// the other ranks' gradients dropped once their last piece is sent.
    fn reduce_scatter_grads(&self, grads: &mut GradStore, present: &[f64]) -> Result<()> {
        let me = self.comm.rank();
        let device = self.comm.device();
        let mut assembling: HashMap<usize, Tensor> = HashMap::new();
        for bucket in self.plan(|i| present[i] > 0.0) {
            let block = bucket.iter().map(|s| count(s)).max().unwrap_or(0);
            let Some(first) = bucket.iter().flatten().next() else {
                continue;
            };
            let dtype = self.params[first.param].1.dtype();
            let mut parts = Vec::new();
            for segment in &bucket {
                for piece in segment {
                    let g = flat_grad(grads, &self.params[piece.param].1)?;
                    parts.push(g.narrow(0, piece.start, piece.len)?.to_device(&device)?);
                }
                let pad = block - count(segment);
                if pad > 0 {
                    parts.push(Tensor::zeros(pad, dtype, &device)?);
                }
            }
            let input = Tensor::cat(&parts, 0)?;
            drop(parts);
            let mine = Tensor::zeros(block, dtype, &device)?;
            self.comm.reduce_scatter(&input, &mine, ReduceOp::Avg)?;
            drop(input);
            for (r, segment) in bucket.iter().enumerate() {
                if r == me {
                    continue;
                }
                for piece in segment.iter().filter(|p| self.is_last(p)) {
                    grads.remove(self.params[piece.param].1.var()?.as_tensor());
                }
            }
            let mut offset = 0;
            for piece in &bucket[me] {
                let var = self.params[piece.param].1.var()?;
                let var = var.as_tensor();
                let values = mine.narrow(0, offset, piece.len)?;
                offset += piece.len;
                let whole = if piece.start == 0 && self.is_last(piece) {
                    Some(values)
                } else {
                    assemble(&mut assembling, piece, var, &values, self.is_last(piece))?
                };
                if let Some(flat) = whole {
                    grads.insert(var, flat.reshape(var.shape())?.to_device(var.device())?);
                }
            }
        }
        Ok(())
    }

    /// Scales the gradients in `grads` so that the norm of all the trained parameters'
    /// gradients, over every rank's partition, is at most `max_norm`, and returns that total
    /// norm: [`clip_grad_norm`](crate::clip_grad_norm) (PyTorch's `clip_grad_norm_`) for sharded
    /// gradients. Every rank must call it, after [`reduce_gradients`](Self::reduce_gradients).
    ///
    /// Each rank computes the norms of the gradients it owns; one all-reduce gives every rank all
    /// of them, and the total is combined in the optimizer's parameter order, so it is bitwise
    /// the total `clip_grad_norm` computes over the whole gradients in one process (PyTorch's
    /// FSDP all-reduces the partial sums of powers instead, which rounds differently). Every
    /// gradient present in `grads` is scaled (at stage 1 that includes other ranks' partitions).
    /// Errors and `error_if_nonfinite` as `clip_grad_norm`'s, on every rank.
    pub fn clip_grad_norm(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
    ) -> Result<f64> {
        clip::check_norm_type(norm_type)?;
        let n = self.params.len();
        let mut local = vec![0.0; 2 * n];
        for (i, (_, p, _)) in self.params.iter().enumerate() {
            if !self.owns(i) {
                continue;
            }
            if let Some(g) = grads.get(p.var()?.as_tensor()) {
                local[i] = clip::grad_norm(g, norm_type)?;
                local[n + i] = 1.0;
            }
        }
        let all = all_sum(self.comm, &local)?;
        let norms: Vec<f64> = (0..n)
            .filter(|&i| all[n + i] > 0.0)
            .map(|i| all[i])
            .collect();
        if norms.is_empty() {
            return Ok(0.0);
        }
        let total = clip::total_norm(&norms, norm_type);
        if error_if_nonfinite && !total.is_finite() {
            return Err(Error::NonFiniteNorm { total, norm_type });
        }
        let coef = clip::coefficient(total, max_norm);
        for (_, p, _) in &self.params {
            let var = p.var()?;
            if let Some(g) = grads.get(var.as_tensor()) {
                let scaled = g.affine(coef, 0.0)?;
                grads.insert(var.as_tensor(), scaled);
            }
        }
        Ok(total)
    }

    /// Every rank's parameters, as their owners hold them, written into every rank's: one
    /// all-gather of equal blocks per bucket of [`plan`](Self::plan); a parameter in several
    /// pieces is written once its last piece has arrived.
    pub(super) fn all_gather_params(&self) -> Result<()> {
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(());
        }
        let me = self.comm.rank();
        let device = self.comm.device();
        let mut assembling: HashMap<usize, Tensor> = HashMap::new();
        for bucket in self.plan(|_| true) {
            let block = bucket.iter().map(|s| count(s)).max().unwrap_or(0);
            let Some(first) = bucket.iter().flatten().next() else {
                continue;
            };
            let dtype = self.params[first.param].1.dtype();
            let mut parts = Vec::new();
            for piece in &bucket[me] {
                let values = self.params[piece.param]
                    .1
                    .var()?
                    .as_tensor()
                    .flatten_all()?;
                parts.push(
                    values
                        .narrow(0, piece.start, piece.len)?
                        .to_device(&device)?,
                );
            }
            let pad = block - count(&bucket[me]);
            if pad > 0 {
                parts.push(Tensor::zeros(pad, dtype, &device)?);
            }
            let input = Tensor::cat(&parts, 0)?;
            drop(parts);
            let output = Tensor::zeros(world * block, dtype, &device)?;
            self.comm.all_gather(&input, &output)?;
            drop(input);
            for (r, segment) in bucket.iter().enumerate() {
                if r == me {
                    continue;
                }
                let mut offset = r * block;
                for piece in segment {
                    let p = &self.params[piece.param].1;
                    let values = output.narrow(0, offset, piece.len)?;
                    offset += piece.len;
                    let whole = if piece.start == 0 && self.is_last(piece) {
                        Some(values)
                    } else {
                        let var = p.var()?;
                        let last = self.is_last(piece);
                        assemble(&mut assembling, piece, var.as_tensor(), &values, last)?
                    };
                    if let Some(flat) = whole {
                        p.set(&flat.reshape(p.shape())?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The elements of a segment.
fn count(segment: &[Piece]) -> usize {
    segment.iter().map(|p| p.len).sum()
}

/// Writes `values`, a piece of parameter `like`'s flat values, into its buffer in `assembling`
/// (made at the first piece: one flat buffer the size of the parameter, so a parameter in many
/// pieces costs one copy of itself, not its pieces and their concatenation); returns the buffer
/// with the last piece.
fn assemble(
    assembling: &mut HashMap<usize, Tensor>,
    piece: &Piece,
    like: &Tensor,
    values: &Tensor,
    last: bool,
) -> Result<Option<Tensor>> {
    let buffer = match assembling.entry(piece.param) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Tensor::zeros(
            like.elem_count(),
            values.dtype(),
            values.device(),
        )?),
    };
    buffer.slice_set(values, 0, piece.start)?;
    Ok(if last {
        assembling.remove(&piece.param)
    } else {
        None
    })
}
