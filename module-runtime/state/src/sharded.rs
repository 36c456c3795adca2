//! Hugging Face's sharded checkpoints, written: [`StateDict::save_sharded`] splits a state dict
//! into safetensors shards of at most a given size and writes the index that maps each key to its
//! shard (`model.safetensors.index.json`), as transformers' `save_pretrained(dir,
//! max_shard_size=...)` and huggingface_hub's `save_torch_state_dict` do; loading such a folder
//! (or its index) is [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict)'s.

use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::io::save_atomically;
use crate::state::StateDict;

/// The single file of a checkpoint that fits one shard, and the index's name otherwise.
const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

impl StateDict {
    /// Saves the state dict into the folder `dir` (created if missing) as Hugging Face shards of
    /// at most `max_shard_size` bytes of tensor data each: `model-00001-of-0000N.safetensors`, …
    /// and `model.safetensors.index.json` (`{"metadata": {"total_size": …}, "weight_map": {key:
    /// file}}`), or one `model.safetensors` when everything fits in one shard — transformers'
    /// `save_pretrained(dir, max_shard_size=...)` for the weights (it takes `"5GB"`, that is
    /// 5,000,000,000). Returns the files written, shards first.
    ///
    /// Tensors go to shards in the state dict's order, a new shard starting where the next tensor
    /// would overflow the current one; a tensor larger than `max_shard_size` gets a shard of its
    /// own (huggingface_hub's split). Each shard is written as
    /// [`save_safetensors`](Self::save_safetensors) writes a file (atomically), the index last;
    /// then the shards of an earlier save in `dir` that this one did not write
    /// (`model-*-of-*.safetensors`, and `model.safetensors` or the index, whichever this save
    /// does not use) are removed, as transformers does. A save killed midway into a folder that
    /// holds an earlier sharded save with as many shards can leave shards of both under the old
    /// index: save into a fresh folder to keep an earlier checkpoint whole until the new one is
    /// complete. `max_shard_size` 0 is [`Error::Io`].
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// let dev = Device::Cpu;
    /// let mut sd = StateDict::new();
    /// for i in 0..3 {
    ///     sd.insert(format!("layers.{i}.weight"), Tensor::ones((16, 16), DType::F32, &dev)?);
    /// }
    /// let dir = std::env::temp_dir().join(format!("sharded-doc-{}", std::process::id()));
    /// let files = sd.save_sharded(&dir, 2048)?; // two 1 KiB tensors per shard
    /// assert_eq!(files.len(), 3); // two shards and the index
    /// assert!(dir.join("model-00002-of-00002.safetensors").exists());
    /// let back = StateDict::read(&dir, &LoadOptions::default())?;
    /// assert_eq!(back.len(), 3);
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn save_sharded(
        &self,
        dir: impl AsRef<Path>,
        max_shard_size: usize,
    ) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        if max_shard_size == 0 {
            return Err(io_error(dir, "max_shard_size is 0"));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            path: dir.to_owned(),
            source: e,
        })?;
        let shards = split(self, max_shard_size);
        if shards.len() <= 1 {
            let path = dir.join(SINGLE);
            self.save_safetensors(&path)?;
            remove_stale(dir, &[SINGLE.to_owned()]);
            return Ok(vec![path]);
        }
        let n = shards.len();
        let mut written = Vec::with_capacity(n + 1);
        let mut weight_map = serde_json::Map::new();
        let mut total_size = 0;
        for (i, entries) in shards.into_iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let mut shard = StateDict::new();
            for (key, t) in entries {
                total_size += t.elem_count() * t.dtype().size_in_bytes();
                weight_map.insert(key.to_owned(), file.clone().into());
                shard.insert(key, t.clone());
            }
            shard.save_safetensors(dir.join(&file))?;
            written.push(file);
        }
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index).map_err(|e| io_error(dir, e))?;
        save_atomically(&dir.join(INDEX), |mut file| {
            std::io::Write::write_all(&mut file, text.as_bytes())
        })?;
        written.push(INDEX.to_owned());
        remove_stale(dir, &written);
        Ok(written.iter().map(|f| dir.join(f)).collect())
    }
}

/// The entries of each shard, in order.
fn split(sd: &StateDict, max_shard_size: usize) -> Vec<Vec<(&str, &Tensor)>> {
    let mut shards: Vec<Vec<(&str, &Tensor)>> = Vec::new();
    let mut current = (Vec::new(), 0usize);
    for (key, t) in sd.iter() {
        let size = t.elem_count() * t.dtype().size_in_bytes();
        if size > max_shard_size {
            shards.push(vec![(key, t)]);
            continue;
        }
        if current.1 + size > max_shard_size && !current.0.is_empty() {
            shards.push(std::mem::take(&mut current.0));
            current.1 = 0;
        }
        current.0.push((key, t));
        current.1 += size;
    }
    if !current.0.is_empty() {
        shards.push(current.0);
    }
    shards
}

/// Removes the checkpoint files of an earlier save in `dir` that are not in `kept`: shards named
/// `model-*-of-*.safetensors`, a single `model.safetensors`, the index. Best effort: a file that
/// cannot be removed stays (the index names only this save's files).
fn remove_stale(dir: &Path, kept: &[String]) {
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in listing.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        let shard =
            name.starts_with("model-") && name.ends_with(".safetensors") && name.contains("-of-");
        if (shard || name == SINGLE || name == INDEX) && !kept.iter().any(|k| k == name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn io_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Io {
        path: path.to_owned(),
        source: std::io::Error::other(message.to_string()),
    }
}
