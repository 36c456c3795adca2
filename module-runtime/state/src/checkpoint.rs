//! One entry point for every checkpoint a PyTorch or Hugging Face user has: it tells the format
//! from the file's first bytes (not its extension) and opens the matching reader, and it joins
//! Hugging Face's sharded checkpoints into one source.
//!
//! | what | how it is recognized |
//! |---|---|
//! | safetensors | an 8-byte little-endian header length, then a JSON header (`{`) |
//! | PyTorch zip (`torch.save` since 1.6: `.pth`, `.pt`, `pytorch_model.bin`) | a zip's `PK\x03\x04` |
//! | PyTorch legacy (before 1.6) | a pickle (`\x80` protocol opcode) |
//! | sharded (`model.safetensors.index.json`, `pytorch_model.bin.index.json`) | JSON with a `weight_map` |
//! | a folder | holds one of Hugging Face's file names, sharded or not |

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Shape, Tensor};

use crate::entries::Entries;
use crate::error::{Error, Result};
use crate::io::{listing, open_for_reading, SafetensorsFile};
use crate::module::Module;
use crate::pth::PthFile;
use crate::report::LoadReport;
use crate::state::{LoadOptions, Source, StateDict};

/// The file names Hugging Face gives a checkpoint in a model folder, in the order they are
/// preferred (safetensors before pickles, as `transformers` does).
const FOLDER_FILES: [&str; 4] = [
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
];

/// What a checkpoint file is, from its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Safetensors,
    PthZip,
    PthLegacy,
    Index,
    Gguf,
}

fn sniff(path: &Path) -> Result<Format> {
    let mut head = Vec::with_capacity(9);
    open_for_reading(path)?
        .take(9)
        .read_to_end(&mut head)
        .map_err(|e| Error::Io {
            path: path.to_owned(),
            source: e,
        })?;
    let head = &head[..];
    let first_non_space = head.iter().find(|b| !b.is_ascii_whitespace());
    Ok(
        if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
            Format::PthZip
        } else if head.starts_with(b"GGUF") {
            Format::Gguf
        } else if head.len() == 9 && head[8] == b'{' {
            // Before the pickle test: a header length's first byte may be 0x80.
            Format::Safetensors
        } else if head.first() == Some(&0x80) && head.get(1).is_some_and(|p| (2..=5).contains(p)) {
            // Pickle's PROTO opcode: `torch.save`'s legacy format starts with a pickled magic number.
            Format::PthLegacy
        } else if first_non_space == Some(&b'{') {
            Format::Index
        } else {
            return Err(Error::Checkpoint {
                path: path.to_owned(),
                reason: format!(
                "not a checkpoint format this crate reads (safetensors, a PyTorch zip or legacy \
                 pickle, a Hugging Face index, or GGUF); it starts with {:02x?}",
                head
            ),
            });
        },
    )
}

/// Opens the checkpoint at `path` (a file of any supported format, an index, or a model folder).
/// `nested` selects the state dict inside a pickled training checkpoint (`"model"` in
/// `{"epoch": 3, "model": ...}`).
pub fn open(path: &Path, nested: Option<&str>) -> Result<Box<dyn Source>> {
    if path.is_dir() {
        let Some(file) = FOLDER_FILES
            .iter()
            .map(|f| path.join(f))
            .find(|p| p.is_file())
        else {
            return Err(Error::Checkpoint {
                path: path.to_owned(),
                reason: format!(
                    "the folder holds none of Hugging Face's checkpoint files ({})",
                    FOLDER_FILES.join(", ")
                ),
            });
        };
        return open(&file, nested);
    }
    Ok(match sniff(path)? {
        Format::Safetensors => Box::new(SafetensorsFile::open(path)?),
        Format::PthZip | Format::PthLegacy => Box::new(PthFile::open(path, nested)?),
        Format::Index => Box::new(Sharded::open(path, nested)?),
        Format::Gguf => Box::new(crate::gguf::GgufFile::read(path, &Device::Cpu)?),
    })
}

/// What [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) loads: a [`StateDict`] in memory
/// (`&sd`), or the path of a checkpoint file or model folder (`"model.safetensors"`,
/// `Path::new(..)`, a `PathBuf`), read lazily.
///
/// A path is opened as [`StateDict::read`] opens it (the format told from the file's first bytes;
/// [`LoadOptions::nested_in`](crate::LoadOptions::nested_in) picks a nested state dict), but
/// every key is checked against the model before any value is read, and values are read one
/// at a time, straight to the parameter's device: a load that fails reads no tensor, and a load to
/// a GPU never holds the whole checkpoint in host memory.
#[derive(Clone, Debug)]
pub enum Checkpoint<'a> {
    /// A state dict in memory (PyTorch's `model.load_state_dict(sd)`).
    StateDict(&'a StateDict),
    /// A checkpoint file or model folder (PyTorch's `model.load_state_dict(torch.load(path))`).
    Path(Cow<'a, Path>),
    /// A GGUF file read into memory (whose tensors a model package may have rearranged first,
    /// as `llama`'s `from_gguf` does).
    Gguf(&'a crate::gguf::GgufFile),
}

impl<'a> From<&'a crate::gguf::GgufFile> for Checkpoint<'a> {
    fn from(file: &'a crate::gguf::GgufFile) -> Self {
        Checkpoint::Gguf(file)
    }
}

impl<'a> From<&'a StateDict> for Checkpoint<'a> {
    fn from(state: &'a StateDict) -> Self {
        Checkpoint::StateDict(state)
    }
}

impl<'a> From<&'a Path> for Checkpoint<'a> {
    fn from(path: &'a Path) -> Self {
        Checkpoint::Path(Cow::Borrowed(path))
    }
}

impl<'a> From<&'a PathBuf> for Checkpoint<'a> {
    fn from(path: &'a PathBuf) -> Self {
        Checkpoint::Path(Cow::Borrowed(path))
    }
}

impl From<PathBuf> for Checkpoint<'_> {
    fn from(path: PathBuf) -> Self {
        Checkpoint::Path(Cow::Owned(path))
    }
}

impl<'a> From<&'a str> for Checkpoint<'a> {
    fn from(path: &'a str) -> Self {
        Checkpoint::Path(Cow::Borrowed(Path::new(path)))
    }
}

impl<'a> From<&'a String> for Checkpoint<'a> {
    fn from(path: &'a String) -> Self {
        Checkpoint::Path(Cow::Borrowed(Path::new(path)))
    }
}

impl From<String> for Checkpoint<'_> {
    fn from(path: String) -> Self {
        Checkpoint::Path(Cow::Owned(path.into()))
    }
}

/// Loads `checkpoint` into `root` with `options` (see [`crate::state::load`]).
pub fn load(
    root: &dyn Module,
    checkpoint: Checkpoint<'_>,
    options: &LoadOptions,
) -> Result<LoadReport> {
    match checkpoint {
        Checkpoint::StateDict(state) => crate::state::load(root, state, options),
        Checkpoint::Gguf(file) => crate::state::load(root, file, options),
        Checkpoint::Path(path) => {
            let source = open(&path, options.nested_key())?;
            crate::state::load(root, source.as_ref(), options)
        }
    }
}

impl StateDict {
    /// Reads every tensor of a checkpoint into a state dict, on the CPU, in the file's order:
    /// PyTorch's `torch.load(path)`. Any format
    /// [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) takes, told from the file's first
    /// bytes (not its extension):
    ///
    /// | what | example |
    /// |---|---|
    /// | safetensors | `model.safetensors` |
    /// | PyTorch zip (`torch.save` since 1.6) | `model.pth`, `model.pt`, `pytorch_model.bin` |
    /// | PyTorch legacy (before 1.6, `_use_new_zipfile_serialization=False`) | `resnet18-5c106cde.pth` |
    /// | Hugging Face shards, through their index | `model.safetensors.index.json`, `pytorch_model.bin.index.json` |
    /// | a model folder holding any of those | `all-MiniLM-L6-v2/` |
    ///
    /// Of `options`, reading uses only [`nested_in`](crate::LoadOptions::nested_in): the state
    /// dict under that key of a pickled training checkpoint (`"model"` in
    /// `{"epoch": 3, "model": ..., "optimizer": ...}`; dotted keys such as `"model.ema"` descend
    /// further). Without it, a pickle whose top level is not a state dict is an
    /// [`Error::Pth`] listing the top-level keys that hold one. Key rules and
    /// strictness apply when the state dict is loaded into a model.
    ///
    /// Shards are read as one state dict: a missing shard, or a key the index maps to a shard that
    /// lacks it, fails the read. Pickles are read by a bounded reader: a truncated, corrupt or
    /// hostile file is an [`Error::Pth`] that says what is wrong, and Python
    /// globals outside PyTorch's tensor types are refused, never executed.
    ///
    /// For inspecting or rewriting a checkpoint without a model; to load one into a model, give
    /// the path to [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) itself, which checks
    /// every key before reading any value.
    ///
    /// ```no_run
    /// use module_runtime::{LoadOptions, StateDict};
    /// let sd = StateDict::read("pytorch_model.bin", &LoadOptions::default())?;
    /// for (key, t) in sd.iter() {
    ///     println!("{key}: {:?} {:?}", t.dims(), t.dtype());
    /// }
    /// let model_only = StateDict::read("checkpoint.pt", &LoadOptions::default().nested_in("model"))?;
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    #[doc(alias = "torch.load")]
    pub fn read(path: impl AsRef<Path>, options: &LoadOptions) -> Result<StateDict> {
        let source = open(path.as_ref(), options.nested_key())?;
        let mut out = StateDict::new();
        for (key, _, _) in source.entries()? {
            let value = source.load(&key, &Device::Cpu)?;
            out.insert(key, value);
        }
        Ok(out)
    }
}

/// A Hugging Face sharded checkpoint: an index (`weight_map`: key → shard file) over shards in its
/// folder, read as one source. Every shard is opened and checked when the index is, so a missing
/// shard, a key the index maps to a shard that lacks it, or a key held by two shards fails before
/// anything is loaded.
struct Sharded {
    shards: Vec<Box<dyn Source>>,
    /// Every key's shape, dtype and shard, in the index's order.
    entries: Entries<(Shape, DType, usize)>,
}

impl Sharded {
    fn open(path: &Path, nested: Option<&str>) -> Result<Self> {
        let bad = |reason: String| Error::Checkpoint {
            path: path.to_owned(),
            reason,
        };
        let text = std::fs::read(path).map_err(|e| Error::Io {
            path: path.to_owned(),
            source: e,
        })?;
        let index: IndexFile =
            serde_json::from_slice(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let Some(InOrder(map)) = index.weight_map else {
            return Err(bad(
                "no `weight_map` object: not a Hugging Face checkpoint index".into(),
            ));
        };
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut files: Vec<String> = Vec::new();
        let mut wanted: Vec<(String, usize)> = Vec::new();
        for (key, file) in &map {
            let Some(file) = file.as_str() else {
                return Err(bad(format!(
                    "`weight_map` maps `{key}` to {file}, not a file name"
                )));
            };
            // Shards live beside the index: a name that climbs out of the folder is refused.
            let plain = Path::new(file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !plain {
                return Err(bad(format!(
                    "`weight_map` maps `{key}` to `{file}`, outside the index's folder"
                )));
            }
            let shard = match files.iter().position(|f| f == file) {
                Some(i) => i,
                None => {
                    files.push(file.to_owned());
                    files.len() - 1
                }
            };
            wanted.push((key.clone(), shard));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut listed: Vec<HashMap<String, (Shape, DType)>> = Vec::new();
        for file in &files {
            let shard_path: PathBuf = folder.join(file);
            if !shard_path.is_file() {
                return Err(bad(format!(
                    "shard `{file}` is missing from {}",
                    folder.display()
                )));
            }
            let source = open(&shard_path, nested)?;
            listed.push(
                source
                    .entries()?
                    .into_iter()
                    .map(|(k, shape, dtype)| (k, (shape, dtype)))
                    .collect(),
            );
            shards.push(source);
        }
        let mut found = Vec::with_capacity(wanted.len());
        for (key, shard) in wanted {
            let Some((shape, dtype)) = listed[shard].remove(&key) else {
                return Err(bad(format!(
                    "the index maps `{key}` to `{}`, which does not hold it",
                    files[shard]
                )));
            };
            found.push((key, (shape, dtype, shard)));
        }
        // Keys a shard holds that the index does not list are loaded too (as `transformers`
        // does, which loads whole shards), unless two shards hold one key.
        for (shard, rest) in listed.into_iter().enumerate() {
            let mut rest: Vec<_> = rest.into_iter().collect();
            rest.sort_by(|a, b| a.0.cmp(&b.0));
            for (key, (shape, dtype)) in rest {
                found.push((key, (shape, dtype, shard)));
            }
        }
        let mut entries = Entries::new();
        for (key, (shape, dtype, shard)) in found {
            if let Some((_, _, first)) = entries.insert(key.clone(), (shape, dtype, shard)) {
                return Err(bad(format!(
                    "`{key}` is in both `{}` and `{}`",
                    files[first], files[shard]
                )));
            }
        }
        Ok(Self { shards, entries })
    }
}

/// The part of a Hugging Face index this reads.
#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: Option<InOrder>,
}

/// A JSON object's entries in the file's order (`serde_json`'s own map sorts its keys).
struct InOrder(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for InOrder {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = InOrder;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object mapping keys to shard file names")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<InOrder, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    out.push(entry);
                }
                Ok(InOrder(out))
            }
        }
        d.deserialize_map(Visitor)
    }
}

impl Source for Sharded {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        Ok(listing(&self.entries))
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        let (_, _, shard) = self.entries.get(key).expect("a key the index lists");
        let shard = *shard;
        self.shards[shard].load(key, device)
    }
}
