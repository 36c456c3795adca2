//! The training attention op over bfloat16 queries, keys and values (autocast's projections):
//! widened to float32 inside the op, computed by the float32 op's passes, the output and the three
//! gradients rounded once to bfloat16. The same bits as the float32 op between casts — three casts
//! in, one out, each a graph node whose gradient candle sums into a zero-filled buffer, and a
//! contiguous copy of the output where the heads are put back side by side — with one node, whose
//! output is the `[B, L, Hq, Ev]` buffer that the float32 op returns (no copy to put the heads
//! back).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::bf16_gemm::{bf16_value, to_bf16};
use crate::fused_grad::attention::{cpu, Attention};
use crate::fused_grad::linear_bf16::to_storage;
use crate::sdpa_kernel::View;

/// The float32 op's passes over bfloat16 tensors (see the module's documentation).
pub(super) struct AttentionBf16(pub(super) Attention);

/// The float32 values of a bfloat16 CPU storage from its start to the last value `layout` reads
/// (exact), as a float32 storage the same layout reads the same values from.
fn widen(
    storage: &CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<CpuStorage> {
    let CpuStorage::BF16(values) = storage else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(
            storage.dtype(),
            op,
        ));
    };
    let end = match layout.shape().elem_count() {
        0 => layout.start_offset(),
        _ => {
            let dims = layout.shape().dims().iter().zip(layout.stride());
            layout.start_offset() + 1 + dims.map(|(d, s)| (d - 1) * s).sum::<usize>()
        }
    };
    let values = values
        .get(..end)
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: a layout past its storage's end")))?;
    let bits: &[u16] = half::slice::HalfFloatSliceExt::reinterpret_cast(values);
    Ok(CpuStorage::F32(
        bits.iter().map(|&b| bf16_value(b)).collect(),
    ))
}

/// Input `index` (0 queries, 1 keys, 2 values) of `op`, `t`, widened as [`widen`] widens it, and
/// the `[B, H, L, E]` layout it is read through ([`Attention::input_layout`]).
fn widen_tensor(
    op: &Attention,
    t: &Tensor,
    index: usize,
    what: &str,
    name: &'static str,
) -> candle_core::Result<(CpuStorage, Layout)> {
    let (storage, layout) = t.storage_and_layout();
    let layout = op.input_layout(index, layout);
    Ok((widen(cpu(&storage, what)?, &layout, name)?, layout))
}

/// Float32 gradient values rounded to a bfloat16 `[B, L, H, X]` buffer of shape `dims`, shaped
/// as the float32 op shapes its gradients ([`Attention::input_grad`]).
fn rounded(
    op: &Attention,
    values: &[f32],
    dims: (usize, usize, usize, usize),
    t: &Tensor,
) -> candle_core::Result<Tensor> {
    op.input_grad(Tensor::from_vec(to_bf16(values), dims, t.device())?)
}

impl candle_core::CustomOp3 for AttentionBf16 {
    fn name(&self) -> &'static str {
        "scaled-dot-product-attention-bf16-fused"
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
        let name = self.name();
        let [ql, kl, vl] = self.0.input_layouts([q_layout, k_layout, v_layout]);
        let (q, k, v) = (
            widen(q, &ql, name)?,
            widen(k, &kl, name)?,
            widen(v, &vl, name)?,
        );
        let out = self.0.forward_values(
            View::new(&q, &ql)?,
            View::new(&k, &kl)?,
            View::new(&v, &vl)?,
        )?;
        Ok((to_storage(&out, DType::BF16), self.0.out_shape()))
    }

    /// The float32 op's backward on the widened values and gradient, each gradient rounded to
    /// bfloat16 (as the backward of the cast into the float32 op rounds it).
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let name = self.name();
        let d = self.0.dims;
        let (qs, ql) = widen_tensor(&self.0, q, 0, "queries", name)?;
        let (ks, kl) = widen_tensor(&self.0, k, 1, "keys", name)?;
        let (vs, vl) = widen_tensor(&self.0, v, 2, "values", name)?;
        let grad = self.0.output_grad(grad)?;
        let (gs, gl) = {
            let (storage, layout) = grad.storage_and_layout();
            (
                widen(cpu(&storage, "gradient")?, layout, name)?,
                layout.clone(),
            )
        };
        let (dq, dk, dv) = self.0.backward_values(
            View::new(&qs, &ql)?,
            View::new(&ks, &kl)?,
            View::new(&vs, &vl)?,
            View::new(&gs, &gl)?,
        )?;
        Ok((
            Some(rounded(&self.0, &dq, (d.b, d.l, d.hq, d.e), q)?),
            Some(rounded(&self.0, &dk, (d.b, d.s, d.h, d.e), k)?),
            Some(rounded(&self.0, &dv, (d.b, d.s, d.h, d.ev), v)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::cpu::bf16_bit_patterns as bits;
    use crate::error::Result;
    use crate::fused_grad::AttentionOptions;
    use crate::sdpa_kernel::Dims;

    /// With the same dropout draws, the output and the query, key and value gradients are the
    /// float32 op's between casts, bit for bit, for heads read through strided views of
    /// bfloat16 projections, grouped-query heads and a float mask that excludes some keys.
    #[test]
    fn equals_the_float32_op_between_casts() -> Result<()> {
        let dev = Device::Cpu;
        let (b, hq, h, l, s, e) = (2, 4, 2, 5, 7, 8);
        let p = 0.2;
        let proj = |len: usize, heads: usize| -> Result<Var> {
            let t = Tensor::randn(0f32, 1., (b, len, heads, e), &dev)?;
            Ok(Var::from_tensor(&t.to_dtype(DType::BF16)?)?)
        };
        let (qv, kv, vv) = (proj(l, hq)?, proj(s, h)?, proj(s, h)?);
        let heads = |v: &Var| v.as_tensor().transpose(1, 2);
        let (q, k, v) = (heads(&qv)?, heads(&kv)?, heads(&vv)?);
        let excluded: Vec<f32> = (0..b * s)
            .map(|i| if i % 5 == 4 { f32::MIN } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(excluded, (b, 1, 1, s), &dev)?.broadcast_as((b, hq, l, s))?;
        let draws = Tensor::rand(0f32, 1f32, (b, hq, l, s), &dev)?;
        let dims = Dims {
            b,
            hq,
            h,
            l,
            s,
            e,
            ev: e,
        };
        let op = || {
            let options = AttentionOptions {
                causal: true,
                scale: 0.35,
                dropout_p: p,
                packed: false,
            };
            Attention::new(Some(&mask), options, &dims, Some(draws.clone()))
        };
        let fused = q.apply_op3(&k, &v, AttentionBf16(op()))?.transpose(1, 2)?;
        let widen = |t: &Tensor| t.to_dtype(DType::F32);
        let cast = widen(&q)?
            .apply_op3(&widen(&k)?, &widen(&v)?, op())?
            .transpose(1, 2)?
            .to_dtype(DType::BF16)?;
        assert_eq!(fused.dtype(), DType::BF16);
        assert_eq!(bits(&fused), bits(&cast));
        let upstream = Tensor::randn(0f32, 1., (b, hq, l, e), &dev)?;
        let loss = |y: &Tensor| (y.to_dtype(DType::F32)? * &upstream)?.sum_all();
        let (gf, gc) = (loss(&fused)?.backward()?, loss(&cast)?.backward()?);
        for var in [&qv, &kv, &vv] {
            let (a, c) = (
                gf.get(var.as_tensor()).unwrap(),
                gc.get(var.as_tensor()).unwrap(),
            );
            assert_eq!(a.dtype(), DType::BF16);
            assert_eq!(bits(a), bits(c));
        }
        Ok(())
    }
}
