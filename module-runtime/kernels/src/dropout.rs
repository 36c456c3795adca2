//! Dropout in training: the entry the dropout layers call.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::fused_grad;
use crate::random;

/// `x` with each element zeroed with probability `p` and the kept ones scaled by `1 / (1 - p)`,
/// for `0 < p < 1` (the layers handle 0 and 1 themselves): on a float32 CPU tensor that records a
/// gradient (fusion on), one op whose backward applies the same mask; elsewhere the mask is a
/// constant of the graph, and gradients flow through the kept elements, scaled. The draws are the
/// runtime's generator's ([`manual_seed`](module_core::manual_seed)) on both paths. A
/// half-precision CPU tensor that records a gradient (under autocast) takes the float32 op and is
/// rounded back (the same draws); for bfloat16 (fusion on) that is one op, widening as it reads.
pub fn dropout(x: &Tensor, p: f64) -> Result<Tensor> {
    if let Some(half) = crate::cpu::cpu_half_dtype(&[x]).filter(|_| x.track_op()) {
        // One op for bfloat16 with fusion on (the same bits as the two casts around the float32
        // op, with one graph node where they make three).
        if half == DType::BF16 && crate::fusion::is_fusion_enabled() {
            return fused_grad::dropout(x, p);
        }
        return Ok(dropout(&crate::cpu::widen(x)?, p)?.to_dtype(half)?);
    }
    if fused_grad::can_fuse_dropout(x) {
        return fused_grad::dropout(x, p);
    }
    let keep = random::rand(0., 1., x.shape(), DType::F32, x.device())?
        .ge(p)?
        .to_dtype(DType::F32)?;
    let mask = (keep * (1.0 / (1.0 - p)))?.to_dtype(x.dtype())?;
    Ok(x.mul(&mask)?)
}
