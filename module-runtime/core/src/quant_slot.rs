//! Where a [`Param`](crate::Param) keeps its quantized weight, and a kernel's layout of it
//! ([`QuantizedLayout`]), which may become the only copy of the weight's bytes.

use std::any::Any;
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Shape};

use crate::error::Result;

/// A layout of a quantized weight that a kernel reads in its own order (repacked blocks), kept
/// with the weight by [`Param::quantized_layout`](crate::Param::quantized_layout).
///
/// A layout that holds every byte of the weight (a permutation of its blocks) says so with
/// [`holds_weight`](Self::holds_weight): the weight's own bytes are then dropped once the layout
/// is made, so the weight is in memory once, and whatever reads the weight (a state dict, a
/// move, an embedding's rows) gets its rows back from the layout ([`row_bytes`](Self::row_bytes)).
pub trait QuantizedLayout: Any + Send + Sync {
    /// Whether the layout holds the whole weight, exactly: `false` unless implemented.
    fn holds_weight(&self) -> bool {
        false
    }

    /// The weight's rows `rows`, in that order, in ggml's layout of their kind (each row its
    /// blocks, as `QTensor::data` lays them out). Called only where
    /// [`holds_weight`](Self::holds_weight) is `true`; the default gives nothing.
    fn row_bytes(&self, rows: &[usize]) -> Vec<u8> {
        let _ = rows;
        Vec::new()
    }
}

/// A parameter's quantized weight: a flag read on every forward (one atomic load, so float
/// parameters pay nothing more) and the weight's entry behind a lock; or, for a parameter with
/// no values yet, the kind it is to be quantized to when its values arrive (a streaming load).
#[derive(Default)]
pub(crate) struct QuantSlot {
    on: AtomicBool,
    entry: RwLock<Option<Arc<Entry>>>,
    pending: RwLock<Option<GgmlDType>>,
}

/// A quantized weight and the layout a kernel made of it, kept together so that a layout always
/// belongs to the weight it was made from.
pub(crate) struct Entry {
    kind: GgmlDType,
    shape: Shape,
    device: Device,
    /// The weight, until a layout that holds all of it is made (then `None`).
    weight: RwLock<Option<Arc<QTensor>>>,
    layout: OnceLock<Option<Layout>>,
    /// Whether `weight` was dropped for the layout.
    dropped: AtomicBool,
}

/// A layout as its own type (for `downcast`) and as what gives the weight's rows back.
struct Layout {
    any: Arc<dyn Any + Send + Sync>,
    rows: Arc<dyn QuantizedLayout>,
    /// It holds the whole weight, which is on the CPU: the weight's own bytes go.
    replaces_weight: bool,
}

impl QuantSlot {
    /// A slot sharing `entry` (a deep copy of a parameter: the same immutable weight).
    pub(crate) fn with_entry(entry: Option<Arc<Entry>>) -> Self {
        Self {
            on: AtomicBool::new(entry.is_some()),
            entry: RwLock::new(entry),
            pending: RwLock::new(None),
        }
    }

    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    pub(crate) fn entry(&self) -> Option<Arc<Entry>> {
        if !self.is_on() {
            return None;
        }
        self.entry.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn store(&self, weight: Option<Arc<QTensor>>) {
        let entry = weight.map(|weight| {
            Arc::new(Entry {
                kind: weight.dtype(),
                shape: weight.shape().clone(),
                device: weight.device(),
                weight: RwLock::new(Some(weight)),
                layout: OnceLock::new(),
                dropped: AtomicBool::new(false),
            })
        });
        let mut slot = self.entry.write().unwrap_or_else(|e| e.into_inner());
        self.on.store(entry.is_some(), Ordering::Release);
        *slot = entry;
        *self.pending.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The kind an unbuilt parameter is to be quantized to when loaded, if one was set.
    pub(crate) fn pending(&self) -> Option<GgmlDType> {
        *self.pending.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets (or clears) the kind an unbuilt parameter is quantized to when loaded.
    pub(crate) fn set_pending(&self, kind: Option<GgmlDType>) {
        *self.pending.write().unwrap_or_else(|e| e.into_inner()) = kind;
    }
}

impl Entry {
    pub(crate) fn kind(&self) -> GgmlDType {
        self.kind
    }

    pub(crate) fn shape(&self) -> &Shape {
        &self.shape
    }

    fn kept(&self) -> Option<Arc<QTensor>> {
        self.weight
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The weight: its own bytes, or made again from the layout that holds them (a copy).
    pub(crate) fn weight(&self) -> Result<Arc<QTensor>> {
        if let Some(weight) = self.kept() {
            return Ok(weight);
        }
        let rows: Vec<usize> = (0..self.shape.dims().first().copied().unwrap_or(0)).collect();
        Ok(Arc::new(self.rows(&rows)?))
    }

    /// Rows `rows` of a matrix weight `[n, k]`, as a quantized `[rows.len(), k]` tensor on the
    /// CPU, read from the weight's bytes or the layout that holds them (a weight on another
    /// device is copied to the CPU whole first). The caller checks `rows < n`.
    pub(crate) fn rows(&self, rows: &[usize]) -> Result<QTensor> {
        let (_, k) = self.shape.dims2()?;
        let bytes = match self.kept() {
            Some(weight) => {
                let data = weight.data()?;
                let row_bytes = k / self.kind.block_size() * self.kind.type_size();
                let mut bytes = Vec::with_capacity(rows.len() * row_bytes);
                for &r in rows {
                    bytes.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
                }
                bytes
            }
            None => match self.layout.get() {
                Some(Some(layout)) => layout.rows.row_bytes(rows),
                // Unreachable: the weight is dropped only once a layout holding it is kept.
                _ => Vec::new(),
            },
        };
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, self.kind)?;
        Ok(QTensor::new(storage, (rows.len(), k))?)
    }

    /// The layout of type `T`, made by `make` on first use; a layout that holds the whole weight
    /// takes the weight's place (see [`QuantizedLayout`]).
    pub(crate) fn layout<T: QuantizedLayout>(
        &self,
        make: impl FnOnce(&QTensor) -> Option<T>,
    ) -> Option<Arc<T>> {
        let layout = self.layout.get_or_init(|| {
            let made = Arc::new(make(&*self.kept()?)?);
            Some(Layout {
                any: made.clone(),
                replaces_weight: made.holds_weight() && self.device.is_cpu(),
                rows: made,
            })
        });
        let layout = layout.as_ref()?;
        // Dropped only once the layout is kept: a reader finds one or the other, always.
        if layout.replaces_weight
            && !self.dropped.load(Ordering::Relaxed)
            && !self.dropped.swap(true, Ordering::AcqRel)
        {
            *self.weight.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
        layout.any.clone().downcast::<T>().ok()
    }
}
