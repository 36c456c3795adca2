//! Checkpoint files: safetensors (written atomically, read memory-mapped) and PyTorch `.pth`/`.bin`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use crate::pth::PthFile;
use crate::state::{Source, StateDict};

/// Writes `state` to `path` atomically: into a temporary file beside it, flushed to disk, then
/// renamed over `path`. An interrupted or failed save leaves any previous file untouched.
pub(crate) fn save_safetensors(state: StateDict, path: &Path) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let file_name = path
        .file_name()
        .ok_or_else(|| io_error(path, std::io::Error::other("the path names no file")))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        candle_core::safetensors::save(&state.into_hash_map(), &tmp).map_err(|e| {
            Error::Checkpoint {
                path: path.to_owned(),
                reason: format!("cannot write {}: {e}", tmp.display()),
            }
        })?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// A safetensors file, memory-mapped: the header is validated on open, values are read only for
/// the entries a load uses.
pub(crate) struct SafetensorsFile {
    path: PathBuf,
    file: MmapedSafetensors,
}

impl SafetensorsFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        if let Err(e) = std::fs::metadata(path) {
            return Err(io_error(path, e));
        }
        // SAFETY: the map is read-only; as with any memory-mapped reader (candle's `VarBuilder`
        // included), the file must not be truncated by another process while it is open.
        let file = unsafe { MmapedSafetensors::new(path) }.map_err(|e| Error::Checkpoint {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            path: path.to_owned(),
            file,
        })
    }

    fn corrupt(&self, reason: String) -> Error {
        Error::Checkpoint {
            path: self.path.clone(),
            reason,
        }
    }
}

impl Source for SafetensorsFile {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        let mut entries = self
            .file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let dtype = DType::try_from(view.dtype()).map_err(|e| {
                    self.corrupt(format!("tensor `{name}` has an unsupported dtype: {e}"))
                })?;
                Ok((name, Shape::from(view.shape().to_vec()), dtype))
            })
            .collect::<Result<Vec<_>>>()?;
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(entries)
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        self.file
            .load(key, device)
            .map_err(|e| self.corrupt(format!("cannot read tensor `{key}`: {e}")))
    }
}

/// Opens a PyTorch pickle checkpoint (`torch.save(model.state_dict())`, `.pth`/`.bin`, zip or
/// legacy format) with the bounded reader. `key` selects a nested dict (e.g. `"state_dict"` or
/// `"model"`).
pub(crate) fn read_pth(path: &Path, key: Option<&str>) -> Result<PthFile> {
    PthFile::open(path, key)
}
