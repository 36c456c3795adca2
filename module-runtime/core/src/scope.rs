//! The thread-local substitution table behind functional calls.
//!
//! A functional scope maps parameter and buffer identities ([`Param::id`](crate::Param::id),
//! [`Buffer::id`](crate::Buffer::id)) to the tensors to read instead, and [`Mode`](crate::Mode)
//! flags (by address) to the train/eval flag to read instead. [`Param::tensor`](crate::Param::tensor),
//! [`Buffer::tensor`](crate::Buffer::tensor) and [`Mode::is_training`](crate::Mode::is_training)
//! consult it, and [`Buffer::set`](crate::Buffer::set)/[`Buffer::replace`](crate::Buffer::replace)
//! write into it, only when [`active`] says a scope is open on this thread: outside a scope the
//! read path pays one thread-local read of a `bool`.
//!
//! Scopes are per thread (another thread, and a plain call on it, sees none of them) and nest: the
//! innermost scope that holds an identity answers for it. A scope is closed by dropping its
//! [`ScopeGuard`], also when the closure it guards panics.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::marker::PhantomData;
use std::rc::Rc;

use candle_core::Tensor;

use crate::error::Result;
use crate::identity::{AddressHasher, IdentitySet};
use crate::lazy_cell::check_same_layout;

type IdMap<V> = HashMap<usize, V, BuildHasherDefault<AddressHasher>>;

thread_local! {
    /// Whether any scope is open on this thread: the one read the hot path makes.
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    /// The open scopes, outermost first.
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// How a scope looks up rows of a `[rows, dim]` parameter: given the flat integer ids, the
/// `[ids, dim]` rows ([`Param::scoped_rows`](crate::Param::scoped_rows)).
pub type RowLookup = Rc<dyn Fn(&Tensor) -> Result<Tensor>>;

/// One scope's substitutions.
#[derive(Default)]
pub struct Frame {
    /// Parameter id -> the tensor to compute with.
    pub params: IdMap<Tensor>,
    /// Parameter id -> the scope's own lookup of rows of it, for layers that read rows of a table
    /// rather than the table (an embedding). A parameter here usually has `params` too, for the
    /// other reads.
    pub rows: IdMap<RowLookup>,
    /// Buffer id -> the scope's copy of the buffer (reads and writes go here).
    pub buffers: IdMap<Tensor>,
    /// The train/eval flag the model's [`Mode`](crate::Mode)s read (by address), if overridden.
    pub training: Option<(bool, IdentitySet)>,
    /// The parameters whose `params` tensor was read ([`ScopeGuard::was_read`]).
    read: RefCell<IdentitySet>,
}

/// Whether a functional scope is open on this thread.
#[inline]
pub fn active() -> bool {
    ACTIVE.with(Cell::get)
}

/// The first of `find`'s answers over the scopes on this thread, innermost first.
fn innermost(find: impl FnMut(&Frame) -> Option<Tensor>) -> Option<Tensor> {
    FRAMES.with(|f| f.borrow().iter().rev().find_map(find))
}

/// The tensor a scope substitutes for the parameter `id`, innermost scope first; the scope
/// that answers records the read ([`ScopeGuard::was_read`]).
#[cold]
pub fn param(id: usize) -> Option<Tensor> {
    innermost(|fr| {
        let t = fr.params.get(&id)?.clone();
        fr.read.borrow_mut().insert(id);
        Some(t)
    })
}

/// The row lookup of the innermost scope that substitutes the parameter `id`: `None` when that
/// scope has only a tensor for it (or no scope has either).
#[cold]
pub fn rows(id: usize) -> Option<RowLookup> {
    FRAMES.with(|f| {
        f.borrow()
            .iter()
            .rev()
            .find(|fr| fr.rows.contains_key(&id) || fr.params.contains_key(&id))
            .and_then(|fr| fr.rows.get(&id).cloned())
    })
}

/// The scope's copy of the buffer `id`, innermost scope first.
#[cold]
pub fn buffer(id: usize) -> Option<Tensor> {
    innermost(|fr| fr.buffers.get(&id).cloned())
}

/// Writes `value` as the buffer `id`'s value in the innermost scope that holds it; `Err(value)`
/// when no scope does (the write goes to the buffer itself).
#[cold]
pub fn write_buffer(id: usize, value: Tensor) -> Result<(), Tensor> {
    FRAMES.with(|f| {
        let mut frames = f.borrow_mut();
        match frames
            .iter_mut()
            .rev()
            .find_map(|fr| fr.buffers.get_mut(&id))
        {
            Some(slot) => {
                *slot = value;
                Ok(())
            }
            None => Err(value),
        }
    })
}

/// The train/eval flag a scope gives the [`Mode`](crate::Mode) at address `addr`.
#[cold]
pub fn training(addr: usize) -> Option<bool> {
    FRAMES.with(|f| {
        f.borrow().iter().rev().find_map(|fr| match &fr.training {
            Some((flag, modes)) if modes.contains(&addr) => Some(*flag),
            _ => None,
        })
    })
}

/// Keeps a scope open on this thread; dropping it closes the scope and hands back its frame.
pub struct ScopeGuard {
    depth: usize,
    _thread_bound: PhantomData<*const ()>,
}

impl ScopeGuard {
    /// Opens a scope with `frame`'s substitutions.
    pub fn enter(frame: Frame) -> Self {
        let depth = FRAMES.with(|f| {
            let mut frames = f.borrow_mut();
            frames.push(frame);
            frames.len()
        });
        ACTIVE.with(|a| a.set(true));
        Self {
            depth,
            _thread_bound: PhantomData,
        }
    }

    /// The buffers' values as the scope leaves them (it stays open).
    pub fn buffer(&self, id: usize) -> Option<Tensor> {
        FRAMES.with(|f| f.borrow().get(self.depth - 1)?.buffers.get(&id).cloned())
    }

    /// Whether this scope's tensor for the parameter `id` has been read since it opened (a read
    /// an inner scope answered does not count). A parameter only looked up by rows was not.
    pub fn was_read(&self, id: usize) -> bool {
        FRAMES.with(|f| {
            f.borrow()
                .get(self.depth - 1)
                .is_some_and(|fr| fr.read.borrow().contains(&id))
        })
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        // Guards are dropped innermost first (they are not `Send`, and each lives in the stack
        // frame of the call that opened it), so this scope is the last one.
        FRAMES.with(|f| {
            let mut frames = f.borrow_mut();
            frames.truncate(self.depth - 1);
            ACTIVE.with(|a| a.set(!frames.is_empty()));
        });
    }
}

/// A write to the buffer `id` inside a scope: goes to the innermost scope's copy when one holds it
/// (`Ok(true)`), after the checks [`Buffer::set`](crate::Buffer::set) makes.
#[cold]
pub fn assign_buffer(id: usize, value: &Tensor) -> Result<bool> {
    let Some(current) = buffer(id) else {
        return Ok(false);
    };
    check_same_layout(&current, value)?;
    // Buffers take no part in autograd (PyTorch updates running statistics under `no_grad`).
    let value = value.to_device(current.device())?.detach();
    let _ = write_buffer(id, value);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A one-element float32 tensor holding `v`.
    fn t(v: f64) -> Tensor {
        Tensor::full(v, 1, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    }

    #[test]
    fn scopes_nest_innermost_first_and_clear_the_flag() {
        let value = |id| param(id).map(|t| t.to_vec1::<f32>().unwrap()[0]);
        assert!(!active());
        let mut outer = Frame::default();
        outer.params.insert(1, t(1.0));
        outer.params.insert(2, t(2.0));
        let outer = ScopeGuard::enter(outer);
        {
            let mut inner = Frame::default();
            inner.params.insert(1, t(10.0));
            let _inner = ScopeGuard::enter(inner);
            assert_eq!(
                (value(1), value(2), value(3)),
                (Some(10.0), Some(2.0), None)
            );
        }
        assert!(active());
        assert_eq!(value(1), Some(1.0));
        drop(outer);
        assert!(!active());
        assert_eq!(value(1), None);
    }

    #[test]
    fn writes_go_to_the_innermost_scope_holding_the_buffer() {
        let read = |id| buffer(id).map(|t| t.to_vec1::<f32>().unwrap()[0]);
        let mut outer = Frame::default();
        outer.buffers.insert(7, t(0.0));
        let _outer = ScopeGuard::enter(outer);
        let inner = ScopeGuard::enter(Frame::default());
        assert!(write_buffer(7, t(5.0)).is_ok());
        assert!(write_buffer(8, t(5.0)).is_err());
        drop(inner);
        assert_eq!(read(7), Some(5.0));
    }

    #[test]
    fn row_lookups_answer_from_the_innermost_scope_and_reads_are_recorded() {
        let lookup: RowLookup = Rc::new(|ids: &Tensor| Ok(ids.to_dtype(DType::F32)?));
        let mut outer = Frame::default();
        outer.params.insert(1, t(1.0));
        outer.rows.insert(1, lookup.clone());
        outer.rows.insert(2, lookup);
        let outer = ScopeGuard::enter(outer);
        assert!(rows(1).is_some() && rows(2).is_some() && rows(3).is_none());
        assert!(!outer.was_read(1));
        {
            // An inner scope with only a tensor for 1 answers for it: no lookup.
            let mut inner = Frame::default();
            inner.params.insert(1, t(10.0));
            let inner = ScopeGuard::enter(inner);
            assert!(rows(1).is_none() && rows(2).is_some());
            assert!(param(1).is_some());
            assert!(inner.was_read(1));
        }
        assert!(!outer.was_read(1), "the inner scope answered that read");
        assert!(param(1).is_some());
        assert!(outer.was_read(1) && !outer.was_read(2));
    }
}
