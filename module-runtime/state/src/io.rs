//! Safetensors files: written atomically ([`StateDict::save_safetensors`], the one writer), read
//! with plain reads.

use std::fs::File;
use std::io::Read;
#[cfg(not(unix))]
use std::io::{Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(unix))]
use std::sync::{Mutex, PoisonError};

use candle_core::{DType, Device, Shape, Tensor};

use crate::entries::Entries;
use crate::error::{Error, Result};
use crate::state::{Source, StateDict};

/// The marker in the names of the temporary files a save writes beside its target
/// (`.model.safetensors.module-tmp-<pid>-<n>`), so a later save can tell its own leftovers.
const TMP_MARK: &str = ".module-tmp-";

impl StateDict {
    /// Saves the state dict as a safetensors file at `path`: `torch.save(state_dict, path)`, and
    /// the one writer behind every file the runtime saves (a model's `save_safetensors`, an
    /// optimizer's `save_state`, a schedule's or a training loop's own state dicts).
    ///
    /// The save is atomic: the file is written beside the target under a temporary name, flushed to
    /// disk (`fsync`), then renamed over the target. A save that fails or is killed midway leaves
    /// any previous file at `path` untouched; a failed save removes its temporary file, and the
    /// next save to the same path removes the temporary files of saves that were killed. A path
    /// that is a folder, or whose folder does not exist, is an [`Error::Io`] naming it.
    ///
    /// As `torch.save`: a symlink is written through (its target is replaced, the link stays), a
    /// new file's permissions follow the umask and an existing file keeps its own.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// let mut sd = StateDict::new();
    /// sd.insert("last_epoch", Tensor::new(3f64, &Device::Cpu)?);
    /// let path = std::env::temp_dir().join(format!("sched-{}.safetensors", std::process::id()));
    /// sd.save_safetensors(&path)?;
    /// let read = StateDict::read(&path, &LoadOptions::default())?;
    /// assert_eq!(read.get("last_epoch").unwrap().to_scalar::<f64>()?, 3.0);
    /// # std::fs::remove_file(&path)?;
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        save_atomically(path.as_ref(), |file| write_safetensors(self, file))
    }
}

/// Writes a file at `path` with `write`, atomically: into a temporary file beside the target
/// (`path`, or the file a symlink there points to), flushed to disk, then renamed over it, the
/// target's permissions kept (a new file's follow the umask); a failed write removes its
/// temporary file, and temporaries of killed saves to the same target are removed first. Every
/// file this crate saves goes through here.
pub(crate) fn save_atomically(
    path: &Path,
    write: impl FnOnce(&File) -> std::io::Result<()>,
) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let target = save_target(path)?;
    let file_name = target
        .file_name()
        .ok_or_else(|| io_error(path, std::io::Error::other("the path names no file")))?;
    let prefix = format!(".{}{TMP_MARK}", file_name.to_string_lossy());
    remove_stale_temporaries(&target, &prefix);
    let tmp = target.with_file_name(format!(
        "{prefix}{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        // `File::create` gives the umask's mode, as `torch.save`'s `open(f, "wb")` does.
        let file = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        write(&file).map_err(|e| io_error(&tmp, e))?;
        if let Ok(existing) = std::fs::metadata(&target) {
            file.set_permissions(existing.permissions())
                .map_err(|e| io_error(&tmp, e))?;
        }
        file.sync_all().map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, &target).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The file a save to `path` replaces: `path`, or the file a symlink at `path` points to (followed
/// through chains of links). Fails, in words, when `path` is a folder or its folder is missing.
fn save_target(path: &Path) -> Result<PathBuf> {
    let mut target = path.to_owned();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&target).map_err(|e| io_error(&target, e))?;
                target = match target.parent() {
                    Some(parent) => parent.join(link),
                    None => link,
                };
            }
            Ok(m) if m.is_dir() => {
                return Err(io_error(
                    path,
                    std::io::Error::other("is a directory: give a file name to save to"),
                ))
            }
            _ => {
                let parent = match target.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                if !parent.is_dir() {
                    return Err(io_error(
                        path,
                        std::io::Error::other(format!(
                            "no such folder `{}` to save into",
                            parent.display()
                        )),
                    ));
                }
                return Ok(target);
            }
        }
    }
    Err(io_error(
        path,
        std::io::Error::other("too many levels of symbolic links"),
    ))
}

/// Removes the temporary files of earlier saves to `target` whose process is gone (killed mid-save).
fn remove_stale_temporaries(target: &Path, prefix: &str) {
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in listing.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !process_alive(pid, &entry) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Whether process `pid` (which wrote `temp`) may still be writing it: on Linux, whether it
/// exists; elsewhere, whether the file changed in the last hour.
fn process_alive(pid: u32, temp: &std::fs::DirEntry) -> bool {
    if cfg!(target_os = "linux") {
        return Path::new("/proc").join(pid.to_string()).exists();
    }
    temp.metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_none_or(|age| age.as_secs() < 3600)
}

/// Writes `state` as safetensors into `file`, streaming one tensor at a time. Tensors are laid out
/// by decreasing element size (as the `safetensors` crate does, so every value stays aligned for
/// zero-copy readers), in state-dict order within a size.
fn write_safetensors(state: &StateDict, file: &File) -> std::io::Result<()> {
    use safetensors::View;
    use std::io::Write;
    let mut order: Vec<(&str, &Tensor)> = state.iter().collect();
    order.sort_by_key(|(_, t)| std::cmp::Reverse(Tensor::dtype(t).size_in_bytes()));
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, t) in &order {
        let len = View::data_len(*t);
        let info = safetensors::tensor::TensorInfo {
            dtype: View::dtype(*t),
            shape: t.dims().to_vec(),
            data_offsets: (offset, offset + len),
        };
        header.insert(
            (*name).to_owned(),
            serde_json::to_value(info).map_err(std::io::Error::other)?,
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    // The data section starts 8-byte aligned: the format pads its header with spaces.
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(&header)?;
    for (_, t) in &order {
        out.write_all(&View::data(*t))?;
    }
    out.flush()
}

/// The keys, shapes and dtypes of a file's entries, whatever else each entry records (where its
/// bytes are): what [`Source::entries`] returns.
pub(crate) fn listing<T>(entries: &Entries<(Shape, DType, T)>) -> Vec<(String, Shape, DType)> {
    entries
        .iter()
        .map(|(name, (shape, dtype, _))| (name.to_owned(), shape.clone(), *dtype))
        .collect()
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// A safetensors file, read without a memory map: the header is read and validated on open
/// (entries, dtypes, offsets, and the file's length against what the header declares), and each
/// value is read with ordinary file reads when a load asks for it.
///
/// Reading instead of mapping means a file truncated or rewritten by another process while it is
/// open gives an error (a short read), never a SIGBUS that would bring the process down; reading
/// from the page cache costs about what copying out of a mapping does.
pub struct SafetensorsFile {
    path: PathBuf,
    /// Read with positioned reads on Unix (no shared cursor, so concurrent loads need no lock);
    /// other platforms seek under `seek_lock`.
    file: File,
    #[cfg(not(unix))]
    seek_lock: Mutex<()>,
    /// Where the data section starts (after the 8-byte length and the JSON header).
    data_start: u64,
    /// Every entry by name, in the order of its data in the file: shape, dtype, byte range.
    entries: Entries<(Shape, DType, (usize, usize))>,
}

/// A JSON object whose keys are all different (its values are skipped): what a safetensors
/// header must be before the `safetensors` crate reads it into a map.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<UniqueKeys, A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "tensor `{key}` is named twice"
                        )));
                    }
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
                Ok(UniqueKeys)
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// The largest header accepted (safetensors' own limit, 100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let corrupt = |reason: String| Error::Checkpoint {
            path: path.to_owned(),
            reason,
        };
        let mut file = open_for_reading(path)?;
        let file_len = file.metadata().map_err(|e| io_error(path, e))?.len();
        let mut len_bytes = [0u8; 8];
        if file_len < 8 {
            return Err(corrupt(format!(
                "{file_len} bytes: too short for a safetensors file (an 8-byte header length, then \
                 the header)"
            )));
        }
        file.read_exact(&mut len_bytes)
            .map_err(|e| io_error(path, e))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
            return Err(corrupt(format!(
                "the header declares {header_len} bytes, but the file holds {file_len} in all \
                 (truncated, or not a safetensors file)"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header)
            .map_err(|e| io_error(path, e))?;
        // The `safetensors` crate reads the header into a map, where a second entry of one name
        // silently replaces the first: a header that names a tensor twice is refused first.
        if let Err(e) = serde_json::from_slice::<UniqueKeys>(&header) {
            return Err(corrupt(format!("invalid safetensors header: {e}")));
        }
        let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&header)
            .map_err(|e| corrupt(format!("invalid safetensors header: {e}")))?;
        let data_start = 8 + header_len;
        let declared = data_start.checked_add(metadata.data_len() as u64);
        if declared != Some(file_len) {
            return Err(corrupt(format!(
                "the header declares {} bytes of tensor data, the file holds {} (truncated or \
                 padded)",
                metadata.data_len(),
                file_len - data_start
            )));
        }
        let mut entries = Entries::new();
        for name in metadata.offset_keys() {
            let info = metadata.info(&name).expect("offset_keys lists known names");
            let dtype = DType::try_from(info.dtype)
                .map_err(|e| corrupt(format!("tensor `{name}` has an unsupported dtype: {e}")))?;
            let shape = Shape::from(info.shape.clone());
            entries.insert(name, (shape, dtype, info.data_offsets));
        }
        Ok(Self {
            path: path.to_owned(),
            file,
            #[cfg(not(unix))]
            seek_lock: Mutex::new(()),
            data_start,
            entries,
        })
    }
}

impl SafetensorsFile {
    /// Fills `buf` from the file at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
        }
        #[cfg(not(unix))]
        {
            let _seeking = self
                .seek_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut file = &self.file;
            file.seek(SeekFrom::Start(offset))?;
            file.read_exact(buf)
        }
    }
}

impl SafetensorsFile {
    /// The `n` values of `T` at `offset` (little-endian, as safetensors stores them), read
    /// straight into the vector that will become a tensor's storage: on Linux without zeroing it
    /// first, and with transparent huge pages for a large one (the kernels' `read_values_at`).
    #[cfg(target_os = "linux")]
    fn read_values<T: bytemuck::Pod>(&self, offset: u64, n: usize) -> std::io::Result<Vec<T>> {
        module_kernels::read_values_at(&self.file, offset, n)
    }

    /// The `n` values of `T` at `offset` (little-endian), read into a zeroed vector.
    #[cfg(not(target_os = "linux"))]
    fn read_values<T: bytemuck::Pod>(&self, offset: u64, n: usize) -> std::io::Result<Vec<T>> {
        let mut values = vec![T::zeroed(); n];
        self.read_at(offset, bytemuck::cast_slice_mut(&mut values))?;
        Ok(values)
    }

    /// The tensor `key` of `n` values of `T` at `start` in the data, as a variable on `device`:
    /// a load that takes it (`assign`, or an empty parameter) copies nothing more on the CPU.
    fn typed<T: candle_core::WithDType + bytemuck::Pod>(
        &self,
        key: &str,
        start: usize,
        shape: &Shape,
        device: &Device,
    ) -> Result<Tensor> {
        #[allow(unused_mut)] // mutated on big-endian targets only
        let mut values = self
            .read_values::<T>(self.data_start + start as u64, shape.elem_count())
            .map_err(|e| self.read_error(key, e))?;
        #[cfg(target_endian = "big")]
        for v in &mut values {
            bytemuck::bytes_of_mut(v).reverse();
        }
        Ok(candle_core::Var::from_vec(values, shape.clone(), device)?.into_inner())
    }

    fn read_error(&self, key: &str, e: std::io::Error) -> Error {
        Error::Checkpoint {
            path: self.path.clone(),
            reason: format!(
                "cannot read tensor `{key}` ({e}): was the file changed while loading?"
            ),
        }
    }
}

impl Source for SafetensorsFile {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        Ok(listing(&self.entries))
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        let (shape, dtype, (start, end)) = self.entries.get(key).expect("a key the file lists");
        // The common dtypes are read straight into the vector that becomes the tensor's storage.
        // The header was validated on open, so `end - start` is the values' size.
        let start = *start;
        let t = match dtype {
            DType::F32 => self.typed::<f32>(key, start, shape, device)?,
            DType::F16 => self.typed::<half::f16>(key, start, shape, device)?,
            DType::BF16 => self.typed::<half::bf16>(key, start, shape, device)?,
            DType::F64 => self.typed::<f64>(key, start, shape, device)?,
            DType::I64 => self.typed::<i64>(key, start, shape, device)?,
            DType::U32 => self.typed::<u32>(key, start, shape, device)?,
            DType::U8 => self.typed::<u8>(key, start, shape, device)?,
            _ => {
                let mut bytes = vec![0u8; end - start];
                self.read_at(self.data_start + start as u64, &mut bytes)
                    .map_err(|e| self.read_error(key, e))?;
                Tensor::from_raw_buffer(&bytes, *dtype, shape.dims(), &Device::Cpu)?
                    .to_device(device)?
            }
        };
        Ok(t)
    }
}

/// Opens `path` for reading, saying in words what is wrong (a folder, a missing file).
pub fn open_for_reading(path: &Path) -> Result<File> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(io_error(
            path,
            std::io::Error::other("is a directory, not a checkpoint file"),
        )),
        Ok(_) => File::open(path).map_err(|e| io_error(path, e)),
        Err(e) => Err(io_error(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another process truncates the file after its header was read: the next read is short,
    /// which is an error. With a memory map it would be a SIGBUS, killing the process.
    #[test]
    fn a_file_truncated_while_open_gives_an_error() {
        let dir = std::env::temp_dir().join(format!("module-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cut.safetensors");
        let t = Tensor::arange(0f32, 4096., &Device::Cpu).unwrap();
        let state: StateDict = [("a", t.clone()), ("b", t)].into_iter().collect();
        state.save_safetensors(&path).unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        assert_eq!(file.entries().unwrap().len(), 2);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(100)
            .unwrap();
        let err = file.load("b", &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("changed while loading"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The names in `dir` that are temporary files of a save.
    fn temporaries(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains(TMP_MARK))
            .collect()
    }

    /// Saves that fail (into a folder that does not exist, onto a folder) are errors naming the
    /// path, and leave the previous file as it was and no temporary file; a save over it replaces
    /// it and leaves none either; a killed save's temporary file goes with the next save.
    #[test]
    fn failed_saves_keep_the_previous_file_and_leave_no_temporary() {
        let dir = std::env::temp_dir().join(format!("module-io-fail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.safetensors");
        let first: StateDict = [("x", Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap())]
            .into_iter()
            .collect();
        first.save_safetensors(&path).unwrap();
        let before = std::fs::read(&path).unwrap();
        let second: StateDict = [("x", Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap())]
            .into_iter()
            .collect();

        let missing = dir.join("no/such/folder/state.safetensors");
        let onto_folder = dir.join("a-folder");
        std::fs::create_dir_all(&onto_folder).unwrap();
        for bad in [&missing, &onto_folder] {
            match second.save_safetensors(bad) {
                Err(Error::Io { path, .. }) => assert_eq!(&path, bad),
                other => panic!("{}: {other:?}", bad.display()),
            }
        }
        assert!(onto_folder.is_dir());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        assert_eq!(temporaries(&dir), Vec::<String>::new());

        let killed = dir.join(format!(".state.safetensors{TMP_MARK}4000000000-0"));
        std::fs::write(&killed, b"half a file").unwrap();
        second.save_safetensors(&path).unwrap();
        assert_ne!(std::fs::read(&path).unwrap(), before);
        assert_eq!(temporaries(&dir), Vec::<String>::new());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
