//! Load transforms: checkpoint tensors that do not map one to one onto a model's, split
//! ([`LoadOptions::split`]), concatenated ([`LoadOptions::cat`]) or transposed
//! ([`LoadOptions::transpose`]) on their way in, declared in the load options.
//!
//! A transform rewrites the pending state dict (`crate::pending`): it records what to do with
//! the values, and nothing is read until the load stages them, after every key and shape has
//! been checked.

use candle_core::Shape;

use crate::error::{Result, TransformError};
use crate::pending::{Entry, Value};
use crate::report::TransformReport;
use crate::state::LoadOptions;

/// One transform, as declared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Transform {
    /// One key into several along `dim`: equal pieces (`sizes: None`) or the sizes given.
    Split {
        from: String,
        sizes: Option<Vec<usize>>,
        dim: usize,
        to: Vec<String>,
    },
    /// Several keys into one along `dim`.
    Cat {
        from: Vec<String>,
        dim: usize,
        to: String,
    },
    /// A matrix's dims 0 and 1 swapped (`Tensor.t()`).
    Transpose { key: String },
}

impl LoadOptions {
    /// Adds a transform; transforms apply in order, after the key rules.
    fn transform(mut self, transform: Transform) -> Self {
        self.transforms.push(transform);
        self
    }

    /// Splits each checkpoint tensor whose key matches `from` into `to.len()` equal pieces along
    /// `dim` (PyTorch's `torch.chunk`, which names the number of pieces), the pieces becoming the
    /// keys `to`, in order. A `*` segment in `from` matches any one segment and is put back where
    /// the `to` keys have `*`, as in [`rename_key`](Self::rename_key), so one rule covers every
    /// layer. A size that the number of pieces does not divide fails the load
    /// ([`TransformError::SplitSizes`]); [`split_with_sizes`](Self::split_with_sizes) gives
    /// unequal sizes.
    ///
    /// PyTorch's `nn.MultiheadAttention` keeps the query, key and value projections stacked in
    /// `in_proj_weight`; into three `Linear`s:
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::StateDict;
    ///
    /// #[derive(Module)]
    /// struct Attention { q: Linear, k: Linear, v: Linear }
    /// let dev = Device::Cpu;
    /// let model = Attention { q: Linear::new(4, 4, &dev)?, k: Linear::new(4, 4, &dev)?, v: Linear::new(4, 4, &dev)? };
    /// let mut sd = StateDict::new(); // what `nn.MultiheadAttention(4, 1).state_dict()` holds
    /// sd.insert("in_proj_weight", Tensor::arange(0f32, 48., &dev)?.reshape((12, 4))?);
    /// sd.insert("in_proj_bias", Tensor::zeros(12, DType::F32, &dev)?);
    /// let options = LoadOptions::default()
    ///     .split("in_proj_weight", 0, ["q.weight", "k.weight", "v.weight"])
    ///     .split("in_proj_bias", 0, ["q.bias", "k.bias", "v.bias"]);
    /// let report = model.load_state_dict(&sd, &options)?;
    /// assert_eq!(report.loaded, 6);
    /// assert_eq!(report.transforms[0].produced, ["q.weight", "k.weight", "v.weight"]);
    /// assert_eq!(model.k.weight.tensor()?.get(0)?.to_vec1::<f32>()?, [16., 17., 18., 19.]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "chunk")]
    pub fn split<S: Into<String>>(
        self,
        from: impl Into<String>,
        dim: usize,
        to: impl IntoIterator<Item = S>,
    ) -> Self {
        self.transform(Transform::Split {
            from: from.into(),
            sizes: None,
            dim,
            to: to.into_iter().map(Into::into).collect(),
        })
    }

    /// [`split`](Self::split) with the pieces' sizes given (PyTorch's `torch.split_with_sizes`):
    /// they must add up to the tensor's size along `dim`, one size per key of `to`.
    ///
    /// ```
    /// use module_runtime::LoadOptions;
    /// // A grouped-query attention's packed projection: 8 query rows, 4 key rows, 4 value rows.
    /// let options = LoadOptions::default().split_with_sizes(
    ///     "layers.*.attn.qkv.weight",
    ///     [8, 4, 4],
    ///     0,
    ///     ["layers.*.attn.q.weight", "layers.*.attn.k.weight", "layers.*.attn.v.weight"],
    /// );
    /// # let _ = options;
    /// ```
    pub fn split_with_sizes<S: Into<String>>(
        self,
        from: impl Into<String>,
        sizes: impl IntoIterator<Item = usize>,
        dim: usize,
        to: impl IntoIterator<Item = S>,
    ) -> Self {
        self.transform(Transform::Split {
            from: from.into(),
            sizes: Some(sizes.into_iter().collect()),
            dim,
            to: to.into_iter().map(Into::into).collect(),
        })
    }

    /// Concatenates the checkpoint tensors `from` along `dim` into the one key `to` (PyTorch's
    /// `torch.cat`): separate query, key and value projections into a model's fused one. `*`
    /// segments work as in [`split`](Self::split): each key that matches the first pattern of
    /// `from` gives the values of the `*`s, which name the other parts and `to`. A missing part
    /// ([`TransformError::MissingPart`]) or parts whose shapes differ outside `dim` or whose
    /// dtypes differ ([`TransformError::CatShapes`]) fail the load.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::StateDict;
    ///
    /// let fused = Linear::no_bias(2, 6, &Device::Cpu)?;
    /// let mut sd = StateDict::new();
    /// for (i, name) in ["q", "k", "v"].iter().enumerate() {
    ///     sd.insert(format!("{name}.weight"), Tensor::full(i as f32, (2, 2), &Device::Cpu)?);
    /// }
    /// let options = LoadOptions::default().cat(["q.weight", "k.weight", "v.weight"], 0, "weight");
    /// fused.load_state_dict(&sd, &options)?;
    /// assert_eq!(fused.weight.tensor()?.to_vec2::<f32>()?[4], [2., 2.]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "concatenate")]
    pub fn cat<S: Into<String>>(
        self,
        from: impl IntoIterator<Item = S>,
        dim: usize,
        to: impl Into<String>,
    ) -> Self {
        self.transform(Transform::Cat {
            from: from.into_iter().map(Into::into).collect(),
            dim,
            to: to.into(),
        })
    }

    /// Transposes each checkpoint matrix whose key matches `key` (`*` segments as in
    /// [`split`](Self::split)), as `Tensor.t()` does: GPT-2's `Conv1D` stores its weight
    /// `[in, out]`, a [`Linear`](../module_runtime/nn/struct.Linear.html) holds `[out, in]`. A
    /// tensor of one dimension (a bias) is left as it is, one of more than two fails the load.
    /// Transforms apply in order, each to the keys the ones before it made, so GPT-2's packed
    /// `c_attn` loads into three `Linear`s as a transpose then a split:
    ///
    /// ```
    /// use module_runtime::LoadOptions;
    /// let options = LoadOptions::default()
    ///     .transpose("h.*.attn.c_attn.weight")
    ///     .split("h.*.attn.c_attn.weight", 0, ["h.*.attn.q.weight", "h.*.attn.k.weight", "h.*.attn.v.weight"])
    ///     .split("h.*.attn.c_attn.bias", 0, ["h.*.attn.q.bias", "h.*.attn.k.bias", "h.*.attn.v.bias"]);
    /// # let _ = options;
    /// ```
    pub fn transpose(self, key: impl Into<String>) -> Self {
        self.transform(Transform::Transpose { key: key.into() })
    }
}

impl Transform {
    /// The rule as the code that declares it.
    pub(crate) fn code(&self) -> String {
        let list = |keys: &[String]| {
            let keys: Vec<String> = keys.iter().map(|k| format!("{k:?}")).collect();
            format!("[{}]", keys.join(", "))
        };
        match self {
            Transform::Split {
                from,
                sizes: None,
                dim,
                to,
            } => format!("split({from:?}, {dim}, {})", list(to)),
            Transform::Split {
                from,
                sizes: Some(sizes),
                dim,
                to,
            } => format!("split_with_sizes({from:?}, {sizes:?}, {dim}, {})", list(to)),
            Transform::Cat { from, dim, to } => format!("cat({}, {dim}, {to:?})", list(from)),
            Transform::Transpose { key } => format!("transpose({key:?})"),
        }
    }

    /// Applies the rule to `entries`; `index` is its place among the load's transforms (what
    /// produced entries record). Fails on anything the rule cannot do; a rule that matches no key
    /// fails a strict load and is reported with nothing consumed in a non-strict one.
    pub(crate) fn apply(
        &self,
        index: usize,
        entries: &mut Vec<Entry>,
        strict: bool,
    ) -> Result<TransformReport> {
        let rule = self.code();
        let mut report = TransformReport {
            rule: rule.clone(),
            ..TransformReport::default()
        };
        self.check(&rule)?;
        let first = match self {
            Transform::Split { from, .. } => from,
            Transform::Cat { from, .. } => &from[0],
            Transform::Transpose { key } => key,
        };
        let matched: Vec<(usize, Vec<String>)> = (entries.iter().enumerate())
            .filter_map(|(i, e)| captures(first, &e.name).map(|c| (i, c)))
            .collect();
        if matched.is_empty() {
            if strict {
                let near = near(first, entries.iter().map(|e| e.name.as_str()));
                return Err(TransformError::NoMatch { rule, near }.into());
            }
            return Ok(report);
        }
        // Each matched entry's replacements, and the entries they take away.
        let mut replaced: Vec<Option<Vec<Entry>>> = vec![None; entries.len()];
        let mut removed = vec![false; entries.len()];
        for (i, caps) in matched {
            if removed[i] {
                continue;
            }
            let entry = &entries[i];
            report.consumed.push(entry.name.clone());
            let made = match self {
                Transform::Split { sizes, dim, to, .. } => split(&rule, entry, sizes, *dim, to)?
                    .into_iter()
                    .zip(to)
                    .map(|((value, shape), to)| (fill(to, &caps), value, shape))
                    .collect(),
                Transform::Transpose { .. } => vec![transpose(&rule, entry)?],
                Transform::Cat { from, dim, to } => {
                    let mut parts = vec![i];
                    for pattern in &from[1..] {
                        let name = fill(pattern, &caps);
                        let at = entries.iter().position(|e| e.name == name);
                        match at.filter(|&at| !removed[at] && replaced[at].is_none()) {
                            Some(at) => parts.push(at),
                            None => {
                                let (found, missing) = (entry.name.clone(), name);
                                let rule = rule.clone();
                                let err = TransformError::MissingPart {
                                    rule,
                                    found,
                                    missing,
                                };
                                return Err(err.into());
                            }
                        }
                    }
                    let entries_of: Vec<&Entry> = parts.iter().map(|&at| &entries[at]).collect();
                    let (value, shape) = cat(&rule, &entries_of, *dim)?;
                    for &at in &parts[1..] {
                        report.consumed.push(entries[at].name.clone());
                        removed[at] = true;
                    }
                    vec![(fill(to, &caps), value, shape)]
                }
            };
            let dtype = entry.dtype;
            let made = made.into_iter().map(|(name, value, shape)| {
                report.produced.push(name.clone());
                Entry {
                    name,
                    value,
                    shape,
                    dtype,
                    rule: Some(index),
                }
            });
            replaced[i] = Some(made.collect());
        }
        let old = std::mem::take(entries);
        for ((entry, made), removed) in old.into_iter().zip(replaced).zip(removed) {
            match made {
                Some(made) => entries.extend(made),
                None if !removed => entries.push(entry),
                None => {}
            }
        }
        Ok(report)
    }

    /// What is wrong with the rule whatever the checkpoint: another number of sizes than of
    /// targets, targets with other `*` segments than the source.
    fn check(&self, rule: &str) -> Result<()> {
        let stars = |p: &str| p.split('.').filter(|s| *s == "*").count();
        let invalid = |message: String| {
            Err(TransformError::InvalidRule {
                rule: rule.to_owned(),
                message,
            }
            .into())
        };
        let (from, to): (&[String], Vec<&String>) = match self {
            Transform::Split {
                from, sizes, to, ..
            } => {
                if let Some(sizes) = sizes.as_ref().filter(|s| s.len() != to.len()) {
                    return invalid(format!(
                        "{} sizes for {} keys: give one size per key",
                        sizes.len(),
                        to.len()
                    ));
                }
                if to.is_empty() {
                    return invalid("no key to split into".into());
                }
                (std::slice::from_ref(from), to.iter().collect())
            }
            Transform::Cat { from, .. } if from.is_empty() => {
                return invalid("no key to concatenate".into());
            }
            Transform::Cat { from, to, .. } => (&from[..1], from[1..].iter().chain([to]).collect()),
            Transform::Transpose { .. } => return Ok(()),
        };
        let n = stars(&from[0]);
        match to.iter().find(|p| stars(p) != n) {
            Some(p) => invalid(format!(
                "`{p}` has {} `*` segment(s) where `{}` has {n}: each `*` takes the segment the first key's `*` matched",
                stars(p),
                from[0]
            )),
            None => Ok(()),
        }
    }
}

/// A split's pieces: values and shapes.
fn split(
    rule: &str,
    entry: &Entry,
    sizes: &Option<Vec<usize>>,
    dim: usize,
    to: &[String],
) -> Result<Vec<(Value, Shape)>> {
    let dims = entry.shape.dims();
    let Some(&size) = dims.get(dim) else {
        return Err(rank_error(rule, entry, dim));
    };
    let bad = || TransformError::SplitSizes {
        rule: rule.to_owned(),
        key: entry.name.clone(),
        shape: entry.shape.clone(),
        dim,
        sizes: sizes.clone().unwrap_or_default(),
        pieces: to.len(),
    };
    let sizes = match sizes {
        Some(sizes) if sizes.iter().sum::<usize>() == size => sizes.clone(),
        None if size % to.len() == 0 => vec![size / to.len(); to.len()],
        _ => return Err(bad().into()),
    };
    let mut start = 0;
    Ok(sizes
        .into_iter()
        .map(|len| {
            let mut shape = dims.to_vec();
            shape[dim] = len;
            let of = Box::new(entry.value.clone());
            let value = Value::Narrow {
                of,
                dim,
                start,
                len,
            };
            start += len;
            (value, Shape::from(shape))
        })
        .collect())
}

/// A transpose's result: the entry's name, value and shape.
fn transpose(rule: &str, entry: &Entry) -> Result<(String, Value, Shape)> {
    let dims = entry.shape.dims();
    match dims.len() {
        0 | 1 => Ok((entry.name.clone(), entry.value.clone(), entry.shape.clone())),
        2 => Ok((
            entry.name.clone(),
            Value::Transpose(Box::new(entry.value.clone())),
            Shape::from((dims[1], dims[0])),
        )),
        _ => Err(TransformError::NotMatrix {
            rule: rule.to_owned(),
            key: entry.name.clone(),
            shape: entry.shape.clone(),
        }
        .into()),
    }
}

/// A concatenation's value and shape, after checking that the parts fit together.
fn cat(rule: &str, parts: &[&Entry], dim: usize) -> Result<(Value, Shape)> {
    let first = parts[0].shape.dims();
    let fits = |e: &&Entry| {
        let dims = e.shape.dims();
        e.dtype == parts[0].dtype
            && dims.len() == first.len()
            && dim < dims.len()
            && (dims.iter().zip(first).enumerate()).all(|(d, (a, b))| d == dim || a == b)
    };
    if !parts.iter().all(fits) {
        return Err(TransformError::CatShapes {
            rule: rule.to_owned(),
            keys: parts.iter().map(|e| e.name.clone()).collect(),
            shapes: parts.iter().map(|e| e.shape.clone()).collect(),
            dtypes: parts.iter().map(|e| e.dtype).collect(),
            dim,
        }
        .into());
    }
    let mut shape = first.to_vec();
    shape[dim] = parts.iter().map(|e| e.shape.dims()[dim]).sum();
    let parts = parts.iter().map(|e| e.value.clone()).collect();
    Ok((Value::Cat { parts, dim }, Shape::from(shape)))
}

fn rank_error(rule: &str, entry: &Entry, dim: usize) -> crate::error::Error {
    TransformError::Rank {
        rule: rule.to_owned(),
        key: entry.name.clone(),
        shape: entry.shape.clone(),
        dim,
    }
    .into()
}

/// The segments `pattern`'s `*`s match in `key`, if it matches (whole segments, as
/// [`KeyRule::RenameKey`](crate::KeyRule::RenameKey)).
fn captures(pattern: &str, key: &str) -> Option<Vec<String>> {
    let (pattern, parts): (Vec<&str>, Vec<&str>) =
        (pattern.split('.').collect(), key.split('.').collect());
    if pattern.len() != parts.len() {
        return None;
    }
    let mut caps = Vec::new();
    for (p, part) in pattern.iter().zip(&parts) {
        match *p {
            "*" => caps.push((*part).to_owned()),
            p if p == *part => {}
            _ => return None,
        }
    }
    Some(caps)
}

/// `pattern` with its `*` segments replaced by `caps`, in order.
fn fill(pattern: &str, caps: &[String]) -> String {
    let mut caps = caps.iter();
    let parts: Vec<&str> = (pattern.split('.'))
        .map(|s| match s {
            "*" => caps.next().map_or("*", String::as_str),
            s => s,
        })
        .collect();
    parts.join(".")
}

/// Up to three keys most like `key` (edit distance), the closest first.
pub fn near<'a>(key: &str, keys: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut ranked: Vec<(usize, &str)> = (keys.filter(|k| !k.is_empty()))
        .map(|k| (strsim::levenshtein(key, k), k))
        .collect();
    ranked.sort();
    ranked.dedup_by(|a, b| a.1 == b.1);
    ranked
        .into_iter()
        .take(3)
        .map(|(_, k)| k.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_capture_and_fill_whole_segments() {
        let caps = captures("h.*.attn.c_attn.weight", "h.11.attn.c_attn.weight").unwrap();
        assert_eq!(caps, ["11"]);
        assert_eq!(fill("h.*.attn.q.weight", &caps), "h.11.attn.q.weight");
        assert!(captures("h.*.attn.c_attn.weight", "h.11.attn.c_attn.bias").is_none());
        assert!(captures("h.*.weight", "h.1.2.weight").is_none());
    }

    #[test]
    fn rules_print_as_the_code_that_declares_them() {
        let rule = Transform::Split {
            from: "in_proj_weight".into(),
            sizes: Some(vec![8, 4, 4]),
            dim: 0,
            to: vec!["q".into(), "k".into(), "v".into()],
        };
        assert_eq!(
            rule.code(),
            r#"split_with_sizes("in_proj_weight", [8, 4, 4], 0, ["q", "k", "v"])"#
        );
        let rule = Transform::Cat {
            from: vec!["q.*".into(), "k".into()],
            dim: 1,
            to: "qk.*".into(),
        };
        // `k` has no `*` where `q.*` has one.
        let err = rule.check(&rule.code()).unwrap_err().to_string();
        assert!(err.contains("`k` has 0 `*` segment(s)"), "{err}");
    }

    fn entry(name: &str, dims: &[usize]) -> Entry {
        Entry {
            name: name.into(),
            value: Value::Key(name.into()),
            shape: Shape::from(dims),
            dtype: candle_core::DType::F32,
            rule: None,
        }
    }

    fn error(rule: Transform, entries: &[Entry]) -> TransformError {
        match rule.apply(0, &mut entries.to_vec(), true) {
            Err(crate::error::Error::Transform(e)) => *e,
            Err(other) => panic!("{other}"),
            Ok(report) => panic!("applied: {report:?}"),
        }
    }

    #[test]
    fn rules_refuse_what_the_shapes_do_not_allow() {
        let entries = [entry("conv.weight", &[4, 3, 3]), entry("w", &[6, 2])];
        let t = Transform::Transpose {
            key: "conv.weight".into(),
        };
        assert!(matches!(
            error(t, &entries),
            TransformError::NotMatrix { .. }
        ));
        let split = |dim, sizes: Option<Vec<usize>>| Transform::Split {
            from: "w".into(),
            sizes,
            dim,
            to: vec!["a".into(), "b".into()],
        };
        let err = error(split(2, None), &entries);
        assert!(matches!(err, TransformError::Rank { dim: 2, .. }), "{err}");
        let err = error(split(0, Some(vec![6])), &entries);
        assert!(matches!(err, TransformError::InvalidRule { .. }), "{err}");
        assert!(err.to_string().contains("1 sizes for 2 keys"), "{err}");
        // An equal split along dim 1 of [6, 2] into two pieces of [6, 1].
        let mut ok = entries.to_vec();
        let report = split(1, None).apply(0, &mut ok, true).unwrap();
        assert_eq!(report.produced, ["a", "b"]);
        assert_eq!(ok[2].shape.dims(), [6, 1]);
        // The parts of a concatenation keep their order; the result takes the first's place.
        let mut parts = vec![entry("x", &[1]), entry("q", &[2, 3]), entry("k", &[1, 3])];
        let cat = Transform::Cat {
            from: vec!["q".into(), "k".into()],
            dim: 0,
            to: "qk".into(),
        };
        let report = cat.apply(0, &mut parts, true).unwrap();
        assert_eq!(report.consumed, ["q", "k"]);
        let names: Vec<&str> = parts.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["x", "qk"]);
        assert_eq!(parts[1].shape.dims(), [3, 3]);
    }
}
