//! `MultiheadAttention`'s masks: their shapes checked against the inputs', and boolean masks
//! turned into additive ones.

use candle_core::{DType, Tensor};

use crate::attention::AttentionInput;
use crate::error::{Error, Result};

/// Checks the masks' shapes against the batch `b`, the query length `l` and the key length `s`
/// before they are reshaped (which would otherwise fail with candle's internal shapes).
pub(crate) fn check_masks(
    input: &AttentionInput<'_>,
    unbatched: bool,
    b: usize,
    l: usize,
    s: usize,
    heads: usize,
) -> Result<()> {
    let invalid = |message: String| {
        Err(Error::InvalidInput {
            layer: "MultiheadAttention",
            message,
        })
    };
    if let Some(mask) = input.key_padding_mask {
        let (expected, what): (&[usize], _) = match unbatched {
            true => (&[s], "[S]"),
            false => (&[b, s], "[B, S]"),
        };
        if mask.dims() != expected {
            let got = mask.dims();
            return invalid(format!(
                "key_padding_mask must be {what} = {expected:?}, got {got:?}"
            ));
        }
    }
    if let Some(mask) = input.attn_mask {
        let ok = mask.dims() == [l, s] || mask.dims() == [b * heads, l, s];
        if !ok {
            let got = mask.dims();
            let batched = [b * heads, l, s];
            return invalid(format!(
                "attn_mask must be [L, S] = {:?} or [B * num_heads, L, S] = {batched:?}, got {got:?}",
                [l, s]
            ));
        }
    }
    Ok(())
}

/// An additive attention mask in `dtype`: integer masks become `-inf` where non-zero and `0`
/// elsewhere; floating-point masks are used as they are.
pub(crate) fn additive_mask(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    if mask.dtype().is_float() {
        return Ok(mask.to_dtype(dtype)?);
    }
    let blocked = mask.ne(&mask.zeros_like()?)?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, mask.shape(), mask.device())?.to_dtype(dtype)?;
    let zero = Tensor::zeros(mask.shape(), dtype, mask.device())?;
    Ok(blocked.where_cond(&neg_inf, &zero)?)
}
