//! What the ranks exchange each step: the gradients (all-reduced or reduce-scattered), the
//! clipping norm, and the updated parameters (all-gathered).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use module_distributed::{plan_buckets, ReduceOp};

use super::{all_sum, flat_grad, sizes, ZeroRedundancyOptimizer, ZeroStage};
use crate::clip;
use crate::error::{Error, Result};

impl<O> ZeroRedundancyOptimizer<'_, O> {
    /// The buckets of `params` (indices) that `keep` keeps, each cut into one segment per rank:
    /// the parameters it owns, in order.
    fn segments(&self, keep: impl Fn(usize) -> bool) -> Vec<Vec<Vec<usize>>> {
        let world = self.comm.world_size();
        plan_buckets(&sizes(&self.params), self.bucket_cap_bytes)
            .into_iter()
            .map(|bucket| {
                let mut per_rank = vec![Vec::new(); world];
                for i in bucket.into_iter().filter(|&i| keep(i)) {
                    per_rank[self.owner[i]].push(i);
                }
                per_rank
            })
            .filter(|per_rank| per_rank.iter().any(|s| !s.is_empty()))
            .collect()
    }

    /// The elements of a segment.
    fn count(&self, segment: &[usize]) -> usize {
        segment.iter().map(|&i| self.params[i].1.elem_count()).sum()
    }

    /// Averages the trained parameters' gradients in `grads` over the ranks; call it after
    /// `loss.backward()` on every rank, before clipping and [`step`](crate::Optimizer::step).
    ///
    /// * [`ZeroStage::One`]: every gradient is all-reduced, in size-capped buckets, as
    ///   [`DistributedDataParallel::reduce_gradients`](module_distributed::DistributedDataParallel::reduce_gradients)
    ///   does (either may be used).
    /// * [`ZeroStage::Two`]: the gradients are reduce-scattered: each rank receives the averages of
    ///   the parameters it owns, and the other gradients are removed from `grads`, their memory
    ///   freed.
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
        for per_rank in self.segments(|i| present[i] > 0.0) {
            match self.stage {
                ZeroStage::One => {
                    let order: Vec<usize> = {
                        let mut all: Vec<usize> = per_rank.concat();
                        all.sort_unstable();
                        all
                    };
                    let pieces = order
                        .iter()
                        .map(|&i| flat_grad(grads, &self.params[i].1))
                        .collect::<Result<Vec<_>>>()?;
                    let flat = Tensor::cat(&pieces, 0)?;
                    drop(pieces);
                    self.comm.all_reduce(&flat, ReduceOp::Avg)?;
                    self.write_grads(grads, &flat, &order)?;
                }
                ZeroStage::Two => {
                    let block = per_rank.iter().map(|s| self.count(s)).max().unwrap_or(0);
                    let dtype = self.params[per_rank.concat()[0]].1.dtype();
                    let device = self.comm.device();
                    let mut pieces = Vec::new();
                    for segment in &per_rank {
                        for &i in segment {
                            pieces.push(flat_grad(grads, &self.params[i].1)?.to_device(&device)?);
                        }
                        let pad = block - self.count(segment);
                        if pad > 0 {
                            pieces.push(Tensor::zeros(pad, dtype, &device)?);
                        }
                    }
                    let input = Tensor::cat(&pieces, 0)?;
                    drop(pieces);
                    let mine = Tensor::zeros(block, dtype, &device)?;
                    self.comm.reduce_scatter(&input, &mine, ReduceOp::Avg)?;
                    drop(input);
                    for (r, segment) in per_rank.iter().enumerate() {
                        if r != self.comm.rank() {
                            for &i in segment {
                                grads.remove(self.params[i].1.var()?.as_tensor());
                            }
                        }
                    }
                    self.write_grads(grads, &mine, &per_rank[self.comm.rank()])?;
                }
            }
        }
        Ok(())
    }

    /// Cuts `flat` back into the gradients of `order`'s parameters, in order.
    fn write_grads(&self, grads: &mut GradStore, flat: &Tensor, order: &[usize]) -> Result<()> {
        let mut offset = 0;
        for &i in order {
            let var = self.params[i].1.var()?;
            let var = var.as_tensor();
            let n = var.elem_count();
            let grad = flat
                .narrow(0, offset, n)?
                .reshape(var.shape())?
                .to_device(var.device())?;
            grads.insert(var, grad);
            offset += n;
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
    /// all-gather per bucket, each rank's segment padded to the longest.
    pub(super) fn all_gather_params(&self) -> Result<()> {
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(());
        }
        let me = self.comm.rank();
        let device = self.comm.device();
        for per_rank in self.segments(|_| true) {
            let block = per_rank.iter().map(|s| self.count(s)).max().unwrap_or(0);
            let dtype: DType = self.params[per_rank.concat()[0]].1.dtype();
            let mut pieces = Vec::new();
            for &i in &per_rank[me] {
                let p = &self.params[i].1;
                pieces.push(p.var()?.as_tensor().flatten_all()?.to_device(&device)?);
            }
            let pad = block - self.count(&per_rank[me]);
            if pad > 0 || pieces.is_empty() {
                pieces.push(Tensor::zeros(pad, dtype, &device)?);
            }
            let input = Tensor::cat(&pieces, 0)?;
            drop(pieces);
            let output = Tensor::zeros(world * block, dtype, &device)?;
            self.comm.all_gather(&input, &output)?;
            for (r, segment) in per_rank.iter().enumerate() {
                if r == me {
                    continue;
                }
                let mut offset = r * block;
                for &i in segment {
                    let p = &self.params[i].1;
                    let n = p.elem_count();
                    p.set(&output.narrow(0, offset, n)?.reshape(p.shape())?)?;
                    offset += n;
                }
            }
        }
        Ok(())
    }
}
