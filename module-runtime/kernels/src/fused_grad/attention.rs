//! Scaled dot-product attention as one op with a one-pass backward, dropout on the weights
//! included.
//!
//! Composed, training attention is a chain of a dozen nodes per layer: the heads copied contiguous,
//! `q·kᵀ`, the scale, the mask broadcast and added, the softmax, the dropout mask, the product with
//! the values, each with its backward and candle's gradient sums. Here the op reads the heads where
//! they lie (views of the projections), and its backward recomputes each query's weights (a row of
//! `S` values: cheaper than keeping them) and writes the query, key and value gradients in one pass
//! per (batch, key/value head), the query heads that share it included.

use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor};

use crate::error::Result;
use crate::pool::par_map;
use crate::sdpa_kernel::{attend, axpy, dot, simd, Dims, Mask, Scores, View};

/// The options of [`attention`] besides the mask.
pub(crate) struct AttentionOptions {
    pub(crate) causal: bool,
    pub(crate) scale: f64,
    pub(crate) dropout_p: f64,
    /// The queries, keys and values are `[B, L, H·E]` (the heads side by side, as the
    /// projections give them) and so is the result: the op reads the heads in place and writes
    /// the result and the gradients that way, with no view nodes around it.
    pub(crate) packed: bool,
}

/// `dropout(softmax(q·kᵀ · scale + mask)) · v` as one node, returned as the `[B, Hq, L, Ev]` view
/// of a `[B, L, Hq, Ev]` buffer (as the inference pass returns it), or, `packed`, as that buffer's
/// `[B, L, Hq·Ev]`. Float32 queries, keys and
/// values, or bfloat16 ones (`attention_bf16.rs`: computed in float32, the output and the
/// gradients rounded once); the mask is float32 or `u8` either way.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    options: AttentionOptions,
    d: &Dims,
) -> Result<Tensor> {
    let draws = if options.dropout_p > 0.0 {
        Some(crate::random::rand(
            0.,
            1.,
            (d.b, d.hq, d.l, d.s),
            DType::F32,
            q.device(),
        )?)
    } else {
        None
    };
    let packed = options.packed;
    let op = Attention::new(mask, options, d, draws);
    let out = match q.dtype() {
        DType::BF16 => q.apply_op3(k, v, super::attention_bf16::AttentionBf16(op))?,
        _ => q.apply_op3(k, v, op)?,
    };
    Ok(if packed { out } else { out.transpose(1, 2)? })
}

/// The candle op of [`attention`]: its arguments are the queries, keys and values.
pub(super) struct Attention {
    /// The mask broadcast to `[B, Hq, L, S]`.
    mask: Option<Tensor>,
    /// Dropout's uniform draws, `[B, Hq, L, S]` contiguous: a weight is kept where its draw is at
    /// least `p` (as the fused dropout op and candle's composed one decide).
    draws: Option<Tensor>,
    causal: bool,
    scale: f32,
    p: f32,
    /// What a kept weight is multiplied by (`1 / (1 - p)`).
    keep_scale: f32,
    pub(super) dims: Dims,
    /// Whether the AVX2 + FMA builds run, forward and backward alike ([`simd`] when made).
    simd: bool,
    /// `[B, L, H·E]` inputs and result ([`AttentionOptions::packed`]).
    packed: bool,
}

/// The CPU storage of one of the op's tensors (a typed error for another device).
pub(super) fn cpu<'a>(storage: &'a Storage, what: &str) -> candle_core::Result<&'a CpuStorage> {
    match storage {
        Storage::Cpu(c) => Ok(c),
        _ => Err(candle_core::Error::Msg(format!(
            "fused attention: the {what} must be on the CPU"
        ))),
    }
}

impl Attention {
    /// The op over `mask` (broadcast to `[B, Hq, L, S]`) with dropout's `draws` (`[B, Hq, L, S]`,
    /// contiguous; `None` without dropout).
    pub(super) fn new(
        mask: Option<&Tensor>,
        options: AttentionOptions,
        d: &Dims,
        draws: Option<Tensor>,
    ) -> Self {
        Self {
            mask: mask.cloned(),
            draws,
            causal: options.causal,
            scale: options.scale as f32,
            p: options.dropout_p as f32,
            keep_scale: (1.0 / (1.0 - options.dropout_p)) as f32,
            dims: *d,
            simd: simd(),
            packed: options.packed,
        }
    }

    /// The `[B, H, L, E]` layouts the queries, keys and values are read through: their own, or,
    /// packed, the heads' views of their `[B, L, H·E]` layouts.
    pub(super) fn input_layouts(&self, layouts: [&Layout; 3]) -> [Layout; 3] {
        std::array::from_fn(|i| self.input_layout(i, layouts[i]))
    }

    /// [`input_layouts`](Self::input_layouts)' layout of input `index` (0 the queries, 1 the
    /// keys, 2 the values).
    pub(super) fn input_layout(&self, index: usize, layout: &Layout) -> Layout {
        if !self.packed {
            return layout.clone();
        }
        let d = self.dims;
        let (h, width) = [(d.hq, d.e), (d.h, d.e), (d.h, d.ev)][index];
        let (dims, stride) = (layout.dims(), layout.stride());
        Layout::new(
            Shape::from((dims[0], h, dims[1], width)),
            vec![stride[0], width * stride[2], stride[1], stride[2]],
            layout.start_offset(),
        )
    }

    /// The forward's output shape: `[B, L, Hq, Ev]`, or, packed, `[B, L, Hq·Ev]`.
    pub(super) fn out_shape(&self) -> Shape {
        let d = self.dims;
        if self.packed {
            Shape::from((d.b, d.l, d.hq * d.ev))
        } else {
            Shape::from((d.b, d.l, d.hq, d.ev))
        }
    }

    /// The output's gradient as the `[B, L, Hq, Ev]` contiguous tensor the backward reads.
    pub(super) fn output_grad(&self, grad: &Tensor) -> candle_core::Result<Tensor> {
        let d = self.dims;
        grad.contiguous()?.reshape((d.b, d.l, d.hq, d.ev))
    }

    /// An input's gradient from its `[B, L, H, X]` buffer: the `[B, H, L, X]` view, or, packed,
    /// the `[B, L, H·X]` buffer itself.
    pub(super) fn input_grad(&self, buffer: Tensor) -> candle_core::Result<Tensor> {
        if self.packed {
            buffer.flatten_from(2)
        } else {
            buffer.transpose(1, 2)
        }
    }

    /// Runs `f` with the weights' inputs (queries, keys, the mask) and the dropout draws.
    fn with_scores<R>(
        &self,
        q: View,
        k: View,
        f: impl FnOnce(&Scores, Option<&[f32]>) -> R,
    ) -> candle_core::Result<R> {
        let mask_lock = self.mask.as_ref().map(Tensor::storage_and_layout);
        let mask = match &mask_lock {
            Some(locked) => Some(Mask::new(cpu(&locked.0, "mask")?, locked.1)),
            None => None,
        };
        let draws_lock = self.draws.as_ref().map(Tensor::storage_and_layout);
        let draws = match &draws_lock {
            Some(locked) => Some(cpu(&locked.0, "draws")?.as_slice::<f32>()?),
            None => None,
        };
        let scores = Scores {
            q,
            k,
            mask,
            causal: self.causal,
            scale: self.scale,
            group: self.dims.hq / self.dims.h,
            e: self.dims.e,
            simd: self.simd,
        };
        Ok(f(&scores, draws))
    }

    /// Dropout's draws for the weights of query `i` of (batch `b`, query head `h`).
    fn draws_row<'a>(&self, draws: &'a [f32], [b, h, i]: [usize; 3]) -> &'a [f32] {
        let Dims { hq, l, s, .. } = self.dims;
        let at = ((b * hq + h) * l + i) * s;
        &draws[at..at + s]
    }

    /// What dropout multiplies a weight by, given its draw: `keep_scale` where it is kept, zero
    /// where it is dropped.
    fn keep(&self, draw: f32) -> f32 {
        if draw >= self.p {
            self.keep_scale
        } else {
            0.0
        }
    }

    /// Dropout's factors for the weights of query `i` of (batch `b`, query head `h`), one
    /// without dropout.
    fn keep_factors(&self, draws: Option<&[f32]>, at: [usize; 3], factors: &mut [f32]) {
        match draws {
            Some(draws) => {
                for (f, &u) in factors.iter_mut().zip(self.draws_row(draws, at)) {
                    *f = self.keep(u);
                }
            }
            None => factors.fill(1.0),
        }
    }
}

/// What one (batch, key/value head) pair's gradients are computed from.
struct PairInputs<'s, 'a> {
    scores: &'s Scores<'a>,
    draws: Option<&'s [f32]>,
    values: View<'a>,
    /// The output's gradient, `[B, L, Hq, Ev]`.
    g: View<'a>,
    /// The batch and the key/value head.
    pair: (usize, usize),
}

/// One pair's gradients: the queries' of its query heads (`[group, L, E]`), the keys'
/// (`[S, E]`) and the values' (`[S, Ev]`).
pub(super) type PairGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

impl Attention {
    /// The gradients of one (batch, key/value head) pair, the query heads that share it included:
    /// per query, its weights recomputed, then `dv += p·g`, `dp = g·v`, `ds = p (dp − Σ p dp)`,
    /// `dq += ds·k`, `dk += ds·q`. Compiled for AVX2 and FMA when the CPU has them.
    fn pair_grads(&self, inputs: &PairInputs) -> PairGrads {
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(op: &Attention, inputs: &PairInputs) -> PairGrads {
                op.pair_grads_body(inputs)
            }
            // SAFETY: the CPU has AVX2 and FMA (`simd`, which set the field).
            return unsafe { avx2(self, inputs) };
        }
        self.pair_grads_body(inputs)
    }

    #[inline(always)]
    fn pair_grads_body(&self, inputs: &PairInputs) -> PairGrads {
        let d = self.dims;
        let group = d.hq / d.h;
        let PairInputs {
            scores,
            draws,
            values,
            g,
            pair: (b, kh),
        } = *inputs;
        let keys = scores.k;
        let queries = scores.q;
        let mut dq = vec![0f32; group * d.l * d.e];
        let mut dk = vec![0f32; d.s * d.e];
        let mut dv = vec![0f32; d.s * d.ev];
        let (mut probs, mut factors, mut dp) = (vec![0f32; d.s], vec![0f32; d.s], vec![0f32; d.s]);
        for (n, dq) in dq.chunks_exact_mut(d.l * d.e).enumerate() {
            let h = kh * group + n;
            for (i, dq) in dq.chunks_exact_mut(d.e).enumerate() {
                scores.probs(b, h, i, &mut probs);
                self.keep_factors(draws, [b, h, i], &mut factors);
                let g_row = g.row([b, i, h], d.ev);
                for j in 0..d.s {
                    dp[j] = dot(g_row, values.row([b, kh, j], d.ev)) * factors[j];
                    let kept = probs[j] * factors[j];
                    if kept != 0.0 {
                        axpy(kept, g_row, &mut dv[j * d.ev..(j + 1) * d.ev]);
                    }
                }
                let sum: f32 = probs.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                let q_row = queries.row([b, h, i], d.e);
                for j in 0..d.s {
                    let ds = probs[j] * (dp[j] - sum) * scores.scale;
                    if ds != 0.0 {
                        axpy(ds, keys.row([b, kh, j], d.e), dq);
                        axpy(ds, q_row, &mut dk[j * d.e..(j + 1) * d.e]);
                    }
                }
            }
        }
        (dq, dk, dv)
    }
}

impl candle_core::CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "scaled-dot-product-attention-fused"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_layout: &Layout,
        k: &CpuStorage,
        k_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let [ql, kl, vl] = self.input_layouts([q_layout, k_layout, v_layout]);
        let (q, k) = (View::new(q, &ql)?, View::new(k, &kl)?);
        let out = self.forward_values(q, k, View::new(v, &vl)?)?;
        Ok((CpuStorage::F32(out), self.out_shape()))
    }

    /// Per (batch, key/value head), for each query of the query heads that share it: the weights
    /// `P` recomputed, `dP = (g · vᵀ) ⊙ dropout`, `dS = P (dP - Σ P dP) · scale`, then
    /// `dq += dS · k`, `dk += dSᵀ · q`, `dv += (P ⊙ dropout)ᵀ · g`.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = self.output_grad(grad)?;
        let (q_lock, k_lock, v_lock, g_lock) = (
            q.storage_and_layout(),
            k.storage_and_layout(),
            v.storage_and_layout(),
            grad.storage_and_layout(),
        );
        let [ql, kl, vl] = self.input_layouts([q_lock.1, k_lock.1, v_lock.1]);
        let (dq, dk, dv) = self.backward_values(
            View::new(cpu(&q_lock.0, "queries")?, &ql)?,
            View::new(cpu(&k_lock.0, "keys")?, &kl)?,
            View::new(cpu(&v_lock.0, "values")?, &vl)?,
            View::new(cpu(&g_lock.0, "gradient")?, g_lock.1)?,
        )?;
        drop((q_lock, k_lock, v_lock, g_lock));
        let d = self.dims;
        let dev = q.device();
        let dq = self.input_grad(Tensor::from_vec(dq, (d.b, d.l, d.hq, d.e), dev)?)?;
        let dk = self.input_grad(Tensor::from_vec(dk, (d.b, d.s, d.h, d.e), dev)?)?;
        let dv = self.input_grad(Tensor::from_vec(dv, (d.b, d.s, d.h, d.ev), dev)?)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl Attention {
    /// The forward's output, `[B, L, Hq, Ev]` values, from float32 queries, keys and values.
    pub(super) fn forward_values(
        &self,
        q: View,
        k: View,
        values: View,
    ) -> candle_core::Result<Vec<f32>> {
        let d = self.dims;
        self.with_scores(q, k, |scores, draws| {
            attend(scores, values, &d, |at, weights| {
                if let Some(draws) = draws {
                    for (w, &u) in weights.iter_mut().zip(self.draws_row(draws, at)) {
                        *w *= self.keep(u);
                    }
                }
            })
        })
    }

    /// The query, key and value gradients (`[B, L, Hq, E]`, `[B, S, H, E]`, `[B, S, H, Ev]`
    /// values) from float32 queries, keys and values and the output's gradient `g`
    /// (`[B, L, Hq, Ev]`).
    pub(super) fn backward_values(
        &self,
        queries: View,
        keys: View,
        values: View,
        g: View,
    ) -> candle_core::Result<PairGrads> {
        let d = self.dims;
        let group = d.hq / d.h;
        let parts = self.with_scores(queries, keys, |scores, draws| {
            par_map((0..d.b * d.h).collect(), |pair| {
                let inputs = PairInputs {
                    scores,
                    draws,
                    values,
                    g,
                    pair: (pair / d.h, pair % d.h),
                };
                self.pair_grads(&inputs)
            })
        })?;
        let mut dq = vec![0f32; d.b * d.l * d.hq * d.e];
        let mut dk = vec![0f32; d.b * d.s * d.h * d.e];
        let mut dv = vec![0f32; d.b * d.s * d.h * d.ev];
        for (pair, (pq, pk, pv)) in parts.iter().enumerate() {
            let (b, kh) = (pair / d.h, pair % d.h);
            for (n, rows) in pq.chunks_exact(d.l * d.e).enumerate() {
                let h = kh * group + n;
                for (i, row) in rows.chunks_exact(d.e).enumerate() {
                    let at = ((b * d.l + i) * d.hq + h) * d.e;
                    dq[at..at + d.e].copy_from_slice(row);
                }
            }
            for j in 0..d.s {
                let at = ((b * d.s + j) * d.h + kh) * d.e;
                dk[at..at + d.e].copy_from_slice(&pk[j * d.e..(j + 1) * d.e]);
                let at = ((b * d.s + j) * d.h + kh) * d.ev;
                dv[at..at + d.ev].copy_from_slice(&pv[j * d.ev..(j + 1) * d.ev]);
            }
        }
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var, D};

    use super::*;
    use crate::cpu::max_diff;

    /// `dropout(softmax(q·kᵀ · scale + mask)) · v` composed of candle's differentiable ops, with
    /// the dropout factors given.
    fn composed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        factors: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
        let shifted = scores
            .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
            .exp()?;
        let probs = shifted.broadcast_div(&shifted.sum_keepdim(D::Minus1)?)?;
        (probs * factors)?.matmul(&v)
    }

    /// With the same dropout draws, the op's output and its query, key and value gradients are
    /// the composed path's, for heads read through strided views and a float mask that excludes
    /// some keys.
    #[test]
    fn the_op_and_its_backward_match_the_composed_path_with_the_same_draws() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, l, s, e) = (2, 3, 5, 6, 8);
        let p = 0.25;
        // Heads as views of [B, L, H, E], as attention layers make them.
        let proj = |len: usize| -> Result<Var> { Ok(Var::randn(0f32, 1., (b, len, h, e), &dev)?) };
        let (qv, kv, vv) = (proj(l)?, proj(s)?, proj(s)?);
        let heads = |v: &Var| v.as_tensor().transpose(1, 2);
        let (q, k, v) = (heads(&qv)?, heads(&kv)?, heads(&vv)?);
        let excluded: Vec<f32> = (0..b * s)
            .map(|i| if i % 5 == 4 { f32::MIN } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(excluded, (b, 1, 1, s), &dev)?;
        let draws = Tensor::rand(0f32, 1f32, (b, h, l, s), &dev)?;
        let factors = (draws.ge(p as f32)?.to_dtype(DType::F32)? / (1.0 - p))?;
        let scale = 0.3;
        let dims = Dims {
            b,
            hq: h,
            h,
            l,
            s,
            e,
            ev: e,
        };
        let options = AttentionOptions {
            causal: false,
            scale,
            dropout_p: p,
            packed: false,
        };
        let full_mask = mask.broadcast_as((b, h, l, s))?;
        let op = Attention::new(Some(&full_mask), options, &dims, Some(draws));
        let fused = q.apply_op3(&k, &v, op)?.transpose(1, 2)?;
        let reference = composed(&q, &k, &v, &mask, scale, &factors)?;
        let upstream = Tensor::randn(0f32, 1., (b, h, l, e), &dev)?;
        assert!(max_diff(&fused, &reference) < 1e-5);
        let g_fused = (fused * &upstream)?.sum_all()?.backward()?;
        let g_ref = (reference * &upstream)?.sum_all()?.backward()?;
        for (name, var) in [("query", &qv), ("key", &kv), ("value", &vv)] {
            let (a, r) = (
                g_fused.get(var.as_tensor()).unwrap(),
                g_ref.get(var.as_tensor()).unwrap(),
            );
            let d = max_diff(a, r);
            assert!(d < 1e-5, "grad.{name} differs by {d}");
        }
        Ok(())
    }
}
