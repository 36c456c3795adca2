//! Merging an adapter into its layer's weight and taking it back out (PEFT's `merge`,
//! `unmerge`, `get_delta_weight`), for LoRA and DoRA on every layer kind.

use candle_core::Tensor;

use crate::error::Result;
use crate::peft::layer::LoraLayer;
use crate::Param;
use module_core::PeftError;

impl LoraLayer {
    /// `scaling · B A` shaped as the base weight (`dims`), the adapter's update of the weight
    /// (PEFT's `get_delta_weight`): `[out, in]` for a `Linear`, `[num_embeddings,
    /// embedding_dim]` for an `Embedding`, a convolution's `[out, in, *kernel]` (B's 1-wide
    /// kernel times A's, PEFT's product for one group). Detached.
    pub(crate) fn delta(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let settings = self.settings(name).expect("a known adapter");
        let delta = match self.lora_embedding_a.get(name) {
            Some(a) => {
                let b = self.lora_embedding_b[name].tensor()?;
                b.matmul(&a.tensor()?)?.t()?
            }
            None => {
                let a = self.lora_a[name].weight().tensor()?;
                let r = a.dim(0)?;
                let b = self.lora_b[name].weight().tensor()?;
                let product = b.reshape(((), r))?.matmul(&a.reshape((r, ()))?)?;
                product.reshape(dims)?
            }
        };
        Ok((delta * settings.scaling)?.detach())
    }

    /// Adds the adapter `name` into `base`'s weight (PEFT's `merge`); DoRA's norms are kept for
    /// [`unmerge`](Self::unmerge). A quantized weight, or a grouped convolution (PEFT refuses it
    /// too), is [`PeftError::State`].
    pub(crate) fn merge(&self, base: &Param, path: &str, name: &str, groups: usize) -> Result<()> {
        if let Some(message) = merge_refused(base, groups) {
            return Err(PeftError::State {
                path: path.to_owned(),
                message,
            }
            .into());
        }
        if self.lock().merged.iter().any(|(n, _)| n == name) {
            return Ok(());
        }
        let settings = self.settings(name).expect("a known adapter");
        let weight = base.tensor()?.detach();
        let delta = self.delta(name, weight.dims())?;
        let (merged, norm) = if settings.use_dora {
            let norm = self.kind.norm(&(&weight + &delta)?)?;
            let factor = self.dora_factor(name, &norm, weight.rank())?;
            ((weight + delta)?.broadcast_mul(&factor)?, Some(norm))
        } else {
            ((weight + delta)?, None)
        };
        base.set(&merged.contiguous()?)?;
        self.lock().merged.push((name.to_owned(), norm));
        Ok(())
    }

    /// DoRA's `magnitude / norm`, shaped to scale a weight of rank `rank`.
    fn dora_factor(&self, name: &str, norm: &Tensor, rank: usize) -> Result<Tensor> {
        let magnitude = self.lora_magnitude_vector[name].weight.tensor()?.detach();
        self.kind
            .weight_view(&(magnitude.flatten_all()? / norm)?, rank)
    }

    /// Takes every merged adapter back out of `base`'s weight, the last merged first (PEFT's
    /// `unmerge`).
    pub(crate) fn unmerge(&self, base: &Param) -> Result<()> {
        loop {
            let Some((name, norm)) = self.lock().merged.pop() else {
                return Ok(());
            };
            let weight = base.tensor()?.detach();
            let delta = self.delta(&name, weight.dims())?;
            let unmerged = match norm {
                Some(norm) => {
                    let factor = self.dora_factor(&name, &norm, weight.rank())?;
                    (weight.broadcast_div(&factor)? - delta)?
                }
                None => (weight - delta)?,
            };
            base.set(&unmerged.contiguous()?)?;
        }
    }
}

/// Why an adapter cannot be merged into `base` (of a layer with `groups`), if it cannot.
pub(crate) fn merge_refused(base: &Param, groups: usize) -> Option<String> {
    if base.is_quantized() {
        return Some("cannot merge an adapter into a quantized weight".into());
    }
    if groups > 1 {
        return Some(format!(
            "cannot merge an adapter into a convolution with groups={groups} (as in PEFT)"
        ));
    }
    None
}
