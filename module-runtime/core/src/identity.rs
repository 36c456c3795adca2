//! Identity: PyTorch tells modules and tensors apart by object identity; Rust values have none, so
//! this file says what stands in for it.
//!
//! - A [`Param`](crate::Param) or [`Buffer`](crate::Buffer) is a shared handle: its identity is the
//!   address of the allocation every clone shares ([`arc_id`]).
//! - A module shared through an `Arc` is one module, whichever `Arc` clone reaches it
//!   ([`Shared::id`]).
//! - A module *call* is told apart by the address and type of the value it is called through
//!   ([`CallTarget`]), which is how hook dispatch finds the called module in the tree.
//!
//! - A module's own train/eval flag (PyTorch's `Module.training`) needs the module's identity
//!   across moves, without a hidden field in user structs: it is kept by the module's *first leaf*
//!   (the first parameter, buffer or [`Mode`](crate::Mode) a walk from the module reaches), under
//!   the leaf's path relative
//!   to the module ([`ModeMarks`]). The relative path tells apart a module and its first child,
//!   which share that leaf (`"0.weight"` from a `Sequential`, `"weight"` from its first `Linear`).
//!
//! Walks remember the identities they have seen in an [`IdentitySet`].

use std::any::Any;
use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, PoisonError};

/// The identity of a shared allocation: equal for every clone of `arc`, distinct otherwise.
pub fn arc_id<T: ?Sized>(arc: &Arc<T>) -> usize {
    Arc::as_ptr(arc) as *const () as usize
}

/// Whether another handle to `arc`'s allocation exists. A parameter or buffer with one handle is
/// held by one field, so a walk can reach it twice only through a shared (`Arc`) module, which the
/// walk dedups itself: such leaves skip the memo set.
pub fn has_aliases<T: ?Sized>(arc: &Arc<T>) -> bool {
    Arc::strong_count(arc) > 1
}

/// The identity methods of a leaf that is an `Arc` of its state (with a `modes` field):
/// [`Param`](crate::Param) and [`Buffer`](crate::Buffer). `$what` names it in the docs.
macro_rules! leaf_identity {
    ($ty:ident, $what:literal) => {
        impl $ty {
            #[doc = concat!("Whether `self` and `other` are the same ", $what, " (aliases of one).")]
            pub fn same_as(&self, other: &$ty) -> bool {
                Arc::ptr_eq(&self.0, &other.0)
            }

            #[doc = concat!(
                "An identity usable as a map key: equal for aliases, distinct for different ",
                $what,
                "s."
            )]
            pub fn id(&self) -> usize {
                $crate::identity::arc_id(&self.0)
            }

            /// The train/eval flags of the modules this is the first leaf of (see
            /// [`ModeMarks`](crate::identity::ModeMarks)).
            pub fn mode_marks(&self) -> &$crate::identity::ModeMarks {
                &self.0.modes
            }

            #[doc = concat!(
                "Whether another handle to this ",
                $what,
                " exists. One with one handle is held by one field, so a walk can reach it \
                 twice only through a shared (`Arc`) module, which the walk dedups itself: \
                 traversal skips its memo set for such leaves."
            )]
            pub fn has_aliases(&self) -> bool {
                $crate::identity::has_aliases(&self.0)
            }
        }
    };
}
pub(crate) use leaf_identity;

/// The train/eval flags of the modules whose first leaf holds this set, by the leaf's path relative
/// to each module. Set by `train`/`eval`, read by `is_training`.
#[derive(Default)]
pub struct ModeMarks(Mutex<Vec<(Box<str>, bool)>>);

impl ModeMarks {
    /// Records the flag of the module from which this leaf is at `relative_path`.
    pub fn set(&self, relative_path: &str, training: bool) {
        let mut marks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match marks.iter_mut().find(|(p, _)| &**p == relative_path) {
            Some((_, flag)) => *flag = training,
            None => marks.push((relative_path.into(), training)),
        }
    }

    /// An independent copy of the flags (for a deep copy of the leaf).
    pub fn snapshot(&self) -> Self {
        let marks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        Self(Mutex::new(marks.clone()))
    }

    /// The flag of the module from which this leaf is at `relative_path`, if one was set.
    pub fn get(&self, relative_path: &str) -> Option<bool> {
        let marks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        marks
            .iter()
            .find(|(p, _)| &**p == relative_path)
            .map(|(_, flag)| *flag)
    }
}

/// A set of identities (addresses of shared allocations). SipHash, the standard hasher, resists
/// adversarial keys, which addresses are not; a multiplicative hash makes the memo set of a walk
/// several times cheaper (`named_parameters` on BERT-base: see BENCHMARKS.md).
pub type IdentitySet = HashSet<usize, BuildHasherDefault<AddressHasher>>;

/// Fibonacci hashing of one `usize`: a multiply by 2^64/φ spreads aligned addresses (whose low bits
/// are zero) over the whole table.
#[derive(Default)]
pub struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The address and type of a value a module is called through: what hook dispatch looks up in the
/// table of a hooked tree, and a forward error looks for among a module's children. Not public API.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallTarget {
    addr: usize,
    ty: std::any::TypeId,
}

impl CallTarget {
    /// `value`'s address and type.
    pub fn of<T: Any>(value: &T) -> Self {
        Self {
            addr: value as *const T as *const () as usize,
            ty: std::any::TypeId::of::<T>(),
        }
    }

    /// The target of a value seen through a trait object (`&dyn Module` upcasts to it).
    pub fn of_dyn(value: &dyn Any) -> Self {
        Self {
            addr: value as *const dyn Any as *const () as usize,
            ty: value.type_id(),
        }
    }
}

/// A module reached through an `Arc`: its identity (shared by every clone of the `Arc`) and the
/// `Arc` value it was reached through (which tells two paths to one module apart when it is called).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shared {
    /// The module's identity: the `Arc`'s target address.
    pub id: usize,
    /// The `Arc` field itself.
    #[doc(hidden)]
    pub holder: CallTarget,
}

impl Shared {
    /// The identity of the module behind `arc`, reached through that `Arc` value.
    pub fn of<M: Any>(arc: &Arc<M>) -> Self {
        Self {
            id: arc_id(arc),
            holder: CallTarget::of(arc),
        }
    }
}
