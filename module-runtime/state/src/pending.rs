//! The state dict a load matches against the model: the checkpoint's keys after the key rules,
//! the transforms ([`crate::transform`]) and the load pre-hooks ([`crate::state_dict_hooks`]),
//! in that order. Values are recipes (a checkpoint key, narrowed, concatenated, transposed),
//! read only when the load stages them, after every key and shape has been checked.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Result, TransformError};
use crate::module::Module;
use crate::report::TransformReport;
use crate::state::{LoadOptions, Source};

/// Where an entry's value comes from.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    /// The source's value under this key.
    Key(String),
    /// A value a load pre-hook inserted.
    Tensor(Tensor),
    /// `len` slices of another value along `dim`, from `start`.
    Narrow {
        of: Box<Value>,
        dim: usize,
        start: usize,
        len: usize,
    },
    /// Values concatenated along `dim`.
    Cat { parts: Vec<Value>, dim: usize },
    /// A matrix's dims 0 and 1 swapped.
    Transpose(Box<Value>),
}

/// One key of the pending state dict.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub name: String,
    pub value: Value,
    pub shape: Shape,
    pub dtype: DType,
    /// The transform that made the entry, by its place in the options.
    pub rule: Option<usize>,
}

/// The pending state dict over a source: a [`Source`] itself, whose keys are model paths.
pub(crate) struct Pending<'a> {
    source: &'a dyn Source,
    pub(crate) entries: Vec<Entry>,
    /// Each name's first entry (a checkpoint may map two keys to one path; the second is
    /// unexpected).
    index: HashMap<String, usize>,
    /// The source values that several entries take (a split's tensor), once read: how many
    /// reads are left and the value on its device. A split reads its tensor once whatever the
    /// order its pieces are staged in, and the value is dropped after its last piece.
    shared: Mutex<HashMap<String, Shared>>,
}

/// A shared source value: the reads left, and the value once read, with its device.
type Shared = (usize, Option<(Device, Tensor)>);

impl<'a> Pending<'a> {
    /// The checkpoint's entries after `options`' key rules, transforms and load pre-hooks, with a
    /// report per transform and per pre-hook that changed anything. Fails if a transform cannot
    /// be applied or produced a key the model lacks (`model_keys`), or a pre-hook fails.
    pub(crate) fn build(
        root: &dyn Module,
        source: &'a dyn Source,
        options: &LoadOptions,
        model_keys: &HashSet<&str>,
    ) -> Result<(Self, Vec<TransformReport>)> {
        let entries = (source.entries()?.into_iter())
            .map(|(key, shape, dtype)| Entry {
                name: options.map_key(&key),
                value: Value::Key(key),
                shape,
                dtype,
                rule: None,
            })
            .collect();
        let mut pending = Pending {
            source,
            entries,
            index: HashMap::new(),
            shared: Mutex::new(HashMap::new()),
        };
        let mut reports = Vec::new();
        for (i, transform) in options.transforms.iter().enumerate() {
            reports.push(transform.apply(i, &mut pending.entries, options.is_strict())?);
        }
        if let Some(hooks) = &options.state_dict_hooks {
            hooks.run_load_pre_hooks(root, &mut pending, options.is_strict(), &mut reports)?;
        }
        for entry in &pending.entries {
            if let Some(rule) = entry.rule
                && !model_keys.contains(entry.name.as_str())
            {
                let near = crate::transform::near(&entry.name, model_keys.iter().copied());
                return Err(TransformError::UnknownTarget {
                    rule: options.transforms[rule].code(),
                    key: entry.name.clone(),
                    near,
                }
                .into());
            }
        }
        pending.reindex();
        let mut uses = HashMap::new();
        for entry in &pending.entries {
            count_keys(&entry.value, &mut uses);
        }
        uses.retain(|_, n| *n > 1);
        let shared = uses.into_iter().map(|(k, n)| (k, (n, None))).collect();
        pending.shared = Mutex::new(shared);
        Ok((pending, reports))
    }

    /// Rebuilds the name index after the entries changed.
    pub(crate) fn reindex(&mut self) {
        self.index.clear();
        for (i, e) in self.entries.iter().enumerate() {
            self.index.entry(e.name.clone()).or_insert(i);
        }
    }

    /// `value` read and computed on `device`.
    pub(crate) fn eval(&self, value: &Value, device: &Device) -> Result<Tensor> {
        Ok(match value {
            Value::Key(key) => {
                let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
                let Some((left, cached)) = shared.get_mut(key) else {
                    drop(shared);
                    return self.source.load(key, device);
                };
                let t = match cached {
                    Some((d, t)) if d.same_device(device) => t.clone(),
                    _ => {
                        let t = self.source.load(key, device)?;
                        *cached = Some((device.clone(), t.clone()));
                        t
                    }
                };
                *left -= 1;
                if *left == 0 {
                    shared.remove(key);
                }
                t
            }
            Value::Tensor(t) => t.to_device(device)?,
            Value::Narrow {
                of,
                dim,
                start,
                len,
            } => self
                .eval(of, device)?
                .narrow(*dim, *start, *len)?
                .contiguous()?,
            Value::Cat { parts, dim } => {
                let parts = (parts.iter())
                    .map(|p| self.eval(p, device))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, *dim)?
            }
            Value::Transpose(of) => self.eval(of, device)?.t()?.contiguous()?,
        })
    }

    fn entry(&self, key: &str) -> &Entry {
        let at = *self.index.get(key).expect("key listed by entries");
        &self.entries[at]
    }
}

/// How many times each source key is read in `value`, added to `uses`.
fn count_keys(value: &Value, uses: &mut HashMap<String, usize>) {
    match value {
        Value::Key(key) => *uses.entry(key.clone()).or_default() += 1,
        Value::Tensor(_) => {}
        Value::Narrow { of, .. } | Value::Transpose(of) => count_keys(of, uses),
        Value::Cat { parts, .. } => parts.iter().for_each(|p| count_keys(p, uses)),
    }
}

impl Source for Pending<'_> {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        Ok((self.entries.iter())
            .map(|e| (e.name.clone(), e.shape.clone(), e.dtype))
            .collect())
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        self.eval(&self.entry(key).value, device)
    }

    /// Only a value taken as it is (no transform) keeps the source's quantized form.
    fn load_quantized(&self, key: &str) -> Result<Option<Arc<QTensor>>> {
        match &self.entry(key).value {
            Value::Key(k) => self.source.load_quantized(k),
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::state::StateDict;

    /// A state dict that counts its reads.
    struct Counting(StateDict, AtomicUsize);

    impl Source for Counting {
        fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
            self.0.entries()
        }
        fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.load(key, device)
        }
    }

    #[test]
    fn a_split_reads_its_tensor_once_and_transposes_compose() -> Result<()> {
        let dev = Device::Cpu;
        let mut sd = StateDict::new();
        // GPT-2's Conv1D layout: [in = 2, out = 6].
        let w = Tensor::arange(0f32, 12., &dev)?.reshape((2, 6))?;
        sd.insert("c_attn.weight", w.clone());
        sd.insert("c_attn.bias", Tensor::arange(0f32, 6., &dev)?);
        let source = Counting(sd, AtomicUsize::new(0));
        let options = LoadOptions::default()
            .transpose("c_attn.weight")
            .transpose("c_attn.bias") // one dimension: left as it is
            .split("c_attn.weight", 0, ["q.weight", "k.weight", "v.weight"]);
        let root = std::marker::PhantomData::<()>; // a module with nothing in it
        let keys: HashSet<&str> = ["q.weight", "k.weight", "v.weight", "c_attn.bias"].into();
        let (pending, reports) = Pending::build(&root, &source, &options, &keys)?;
        let names: Vec<String> = pending.entries()?.into_iter().map(|e| e.0).collect();
        assert_eq!(names, ["q.weight", "k.weight", "v.weight", "c_attn.bias"]);
        assert_eq!(reports[1].produced, ["c_attn.bias"]);
        // The pieces staged with another key between them, as a model's order has them.
        for (i, key) in ["q.weight", "k.weight", "v.weight"].iter().enumerate() {
            let expected = w.t()?.narrow(0, 2 * i, 2)?.to_vec2::<f32>()?;
            assert_eq!(pending.load(key, &dev)?.to_vec2::<f32>()?, expected);
            pending.load("c_attn.bias", &dev)?;
        }
        // The weight once, the bias (not shared) each time; nothing kept after the last piece.
        assert_eq!(source.1.load(Ordering::Relaxed), 4);
        assert!(pending.shared.lock().unwrap().is_empty());
        Ok(())
    }
}
