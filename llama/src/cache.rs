//! The key/value cache: a decoder's recurrent state, as a value.
//!
//! Every layer has a key and a value buffer `[batch, kv_heads, capacity, head_dim]`; the first
//! [`len`](KvCache::len) slots are filled. Rows of a batch may start with padding (left padding,
//! from an attention mask): row `i`'s first [`padding`](KvCache::padding)`[i]` slots are never
//! attended to, and its tokens' positions count from the first slot after them. New tokens are
//! written into the buffers in place; when they are full, every buffer is reallocated at twice
//! its capacity (amortized: no copy of the whole cache per token).

use module_runtime::prelude::*;
use module_runtime::TensorStruct;

use crate::config::invalid;

/// The key/value cache of a [`LlamaForCausalLM`](crate::LlamaForCausalLM): its
/// [`Recurrent`] state, a value.
///
/// [`Clone`] copies the buffers (a real copy: the clone and the original grow independently, as
/// beam search and speculative decoding need); [`truncate`](Self::truncate) forgets the last
/// tokens. The buffers are written in place by the next step, so a tensor taken out of a cache
/// (through [`TensorTree`](module_runtime::TensorTree)) sees later writes to its slots.
///
/// ```
/// use llama::LlamaForCausalLM;
/// use module_runtime::prelude::*;
/// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
/// let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
/// let prompt = Tensor::new(&[[242u32, 175, 307]], &Device::Cpu)?;
/// let (_, cache) = model.scan(&prompt, model.initial_state(1)?)?;
/// let token = |t: u32| Tensor::new(&[t], &Device::Cpu);
///
/// let branch = cache.clone(); // beam search: two continuations of one prefix
/// let (a, mut cache) = model.step(&token(5)?, cache)?;
/// let (b, _) = model.step(&token(5)?, branch)?;
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
///
/// cache.truncate(3)?; // speculative decoding: drop the rejected token
/// assert_eq!((cache.len(), cache.positions()), (3, vec![3]));
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(TensorStruct)]
pub struct KvCache {
    /// `(keys, values)` per layer, each `[batch, kv_heads, capacity, head_dim]`.
    pub layers: Vec<(Tensor, Tensor)>,
    /// Filled slots.
    #[tensor(skip)]
    len: usize,
    /// Leading padding slots per row.
    #[tensor(skip)]
    padding: Vec<usize>,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let copy = |t: &Tensor| t.copy().expect("copying a cache buffer");
        Self {
            layers: self
                .layers
                .iter()
                .map(|(k, v)| (copy(k), copy(v)))
                .collect(),
            len: self.len,
            padding: self.padding.clone(),
        }
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layers", &self.layers.len())
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("padding", &self.padding)
            .finish()
    }
}

impl KvCache {
    /// An empty cache for `layers` layers and `batch` rows, with room for `capacity` tokens
    /// before it grows.
    pub fn new(
        layers: usize,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let shape = (batch, kv_heads, capacity.max(1), head_dim);
        let buffer = || Tensor::zeros(shape, dtype, device);
        Ok(Self {
            layers: (0..layers)
                .map(|_| Ok((buffer()?, buffer()?)))
                .collect::<Result<_>>()?,
            len: 0,
            padding: vec![0; batch],
        })
    }

    /// Filled slots (padding included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows.
    pub fn batch(&self) -> usize {
        self.padding.len()
    }

    /// Slots the buffers hold before they grow.
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Leading padding slots of each row.
    pub fn padding(&self) -> &[usize] {
        &self.padding
    }

    /// The position of the next token of each row (its tokens so far, padding excluded).
    pub fn positions(&self) -> Vec<usize> {
        self.padding
            .iter()
            .map(|p| self.len.saturating_sub(*p))
            .collect()
    }

    /// Forgets every slot after the first `len` (speculative decoding's rejected tokens, or a
    /// shared prefix). Nothing is copied; the next tokens overwrite the forgotten slots.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(invalid(format!(
                "cannot truncate a cache of {} tokens to {len}",
                self.len
            )));
        }
        self.len = len;
        for p in &mut self.padding {
            *p = (*p).min(len);
        }
        Ok(())
    }

    /// Marks the first slots of each row as padding; only on an empty cache, before the prompt.
    /// A later chunk without padding keeps the padding the first one set.
    pub(crate) fn set_padding(&mut self, padding: Vec<usize>) -> Result<()> {
        if !self.is_empty() {
            if padding.iter().any(|p| *p > 0) {
                return Err(invalid(
                    "padding (attention mask zeros) is only allowed in the first chunk of a cache"
                        .to_owned(),
                ));
            }
            return Ok(());
        }
        self.padding = padding;
        Ok(())
    }

    /// Makes room for `extra` more tokens: a new buffer of at least twice the capacity when full,
    /// with the filled slots copied over once.
    pub(crate) fn reserve(&mut self, extra: usize) -> Result<()> {
        let needed = self.len + extra;
        let capacity = self.capacity();
        if needed <= capacity {
            return Ok(());
        }
        let grown = needed.max(2 * capacity);
        for (k, v) in &mut self.layers {
            for t in [k, v] {
                let (b, h, _, d) = t.dims4()?;
                let bigger = Tensor::zeros((b, h, grown, d), t.dtype(), t.device())?;
                bigger.slice_set(&t.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                *t = bigger;
            }
        }
        Ok(())
    }

    /// Counts `extra` newly written slots.
    pub(crate) fn advance(&mut self, extra: usize) {
        self.len += extra;
    }
}
