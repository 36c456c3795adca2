//! Where offloaded parameters' values are kept: a tensor in CPU memory (`cpu` on a map computing
//! on a GPU) and a safetensors file per weight in the offload folder (`disk`), both read into a
//! fresh tensor on the execution device each time the parameter is read.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use module_core::OffloadSource;
use module_state::StateDict;

/// How many times offloaded values were read, and how many bytes: shared by a dispatch's sources
/// and its [`DispatchTrace`](super::DispatchTrace).
#[derive(Debug, Default)]
pub(super) struct LoadCounter {
    pub(super) loads: AtomicUsize,
    pub(super) bytes: AtomicUsize,
}

impl LoadCounter {
    fn count(&self, t: &Tensor) {
        self.loads.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(
            t.elem_count() * t.dtype().size_in_bytes(),
            Ordering::Relaxed,
        );
    }
}

/// A weight kept in CPU memory, copied to the execution device on each read (Accelerate's
/// `cpu_offload`).
pub(super) struct HostWeight {
    value: Mutex<Tensor>,
    device: Device,
    counter: Arc<LoadCounter>,
}

impl HostWeight {
    pub(super) fn new(value: Tensor, device: &Device, counter: Arc<LoadCounter>) -> Self {
        Self {
            value: Mutex::new(value),
            device: device.clone(),
            counter,
        }
    }
}

impl OffloadSource for HostWeight {
    fn load(&self) -> Result<Tensor> {
        let host = self
            .value
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // On the CPU itself a copy, so that the reader's tensor is its own (it frees it).
        let t = match self.device.is_cpu() {
            true => host.copy()?,
            false => host.to_device(&self.device)?,
        };
        self.counter.count(&t);
        Ok(t)
    }

    fn store(&self, value: &Tensor) -> Result<()> {
        let host = value.to_device(&Device::Cpu)?.copy()?;
        *self.value.lock().unwrap_or_else(PoisonError::into_inner) = host;
        Ok(())
    }

    fn layout(&self) -> Result<(Shape, DType)> {
        let host = self.value.lock().unwrap_or_else(PoisonError::into_inner);
        Ok((host.shape().clone(), host.dtype()))
    }

    fn location(&self) -> String {
        "cpu".into()
    }
}

/// A weight kept in a safetensors file of its own (`<folder>/<path>.safetensors`, the tensor
/// under its path), read straight into a fresh tensor on each read (Accelerate's disk offload).
pub(super) struct DiskWeight {
    file: PathBuf,
    key: String,
    device: Device,
    counter: Arc<LoadCounter>,
}

impl DiskWeight {
    /// The weight `key` in `folder`, read on `device`; its file may not exist yet
    /// ([`file`](Self::file), [`store`](OffloadSource::store) writes it).
    pub(super) fn new(
        folder: &Path,
        key: &str,
        device: &Device,
        counter: Arc<LoadCounter>,
    ) -> Self {
        Self {
            file: folder.join(format!("{key}.safetensors")),
            key: key.to_owned(),
            device: device.clone(),
            counter,
        }
    }

    /// The file the weight is kept in.
    pub(super) fn file(&self) -> &Path {
        &self.file
    }
}

impl OffloadSource for DiskWeight {
    fn load(&self) -> Result<Tensor> {
        let source = module_state::checkpoint::open(&self.file, None)?;
        let t = source.load(&self.key, &self.device)?;
        self.counter.count(&t);
        Ok(t)
    }

    fn store(&self, value: &Tensor) -> Result<()> {
        let mut one = StateDict::new();
        one.insert(self.key.clone(), value.to_device(&Device::Cpu)?);
        one.save_safetensors(&self.file)
    }

    fn layout(&self) -> Result<(Shape, DType)> {
        let source = module_state::checkpoint::open(&self.file, None)?;
        let entries = source.entries()?;
        match entries.into_iter().find(|(key, _, _)| *key == self.key) {
            Some((_, shape, dtype)) => Ok((shape, dtype)),
            None => Err(Error::Checkpoint {
                path: self.file.clone(),
                reason: format!("it holds no tensor `{}`", self.key),
            }),
        }
    }

    fn location(&self) -> String {
        format!("disk ({})", self.file.display())
    }
}
